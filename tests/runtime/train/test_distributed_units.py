"""Single-process parts of the distributed engine: token balancing, micro-batching and clustering, negatives,
the per-step schedule and batch preparation."""

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset

from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.data.synth import synthesize
from grstack.runtime.train import balance, microbatching
from grstack.runtime.train.batching import BatchStream, Preparer, Schedule
from grstack.runtime.train.negatives import (
    HostOffload,
    step_generator,
)
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit


def _heavy_tailed(n, seed=0):
    return np.minimum(np.random.default_rng(seed).lognormal(np.log(200), 1.0, n).astype(np.int64) + 10, 2000)


def test_token_balancing_beats_equal_counts_and_reaches_the_target():
    before, after = [], []
    for step in range(30):
        lengths = _heavy_tailed(64, seed=step)
        a, b = 1.0, 0.01
        before.append(balance.imbalance(balance.rank_costs(lengths, balance.split_by_count(64, 2), a, b)))
        parts = balance.assign(lengths, 2, "tokens", a, b)
        after.append(balance.imbalance(balance.rank_costs(lengths, parts, a, b)))
        assert sorted(np.concatenate(parts).tolist()) == list(range(64))
        assert all(len(p) >= 1 for p in parts)
    assert np.mean(before) > 0.1
    assert np.mean(after) <= 0.03
    assert balance.imbalance(np.array([1.0, 1.0])) == 0.0
    assert balance.wait_ratio(np.array([2.0, 1.0])) == pytest.approx(0.25)


def test_global_batches_by_count_and_by_token_budget():
    lengths = np.array([5, 1, 1, 1, 10, 2, 2, 3, 1])
    by_count = balance.global_batches(lengths, 2, batch_size=4)
    assert [b.tolist() for b in by_count] == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]  # a 1-sequence tail joins
    by_tokens = balance.global_batches(lengths, 2, batch_size=4, token_budget=3)
    assert np.concatenate(by_tokens).tolist() == list(range(9))
    assert all(len(b) >= 2 and (lengths[b].sum() >= 6 or b is by_tokens[-1]) for b in by_tokens)


def test_micro_batches_are_non_empty_and_cover_the_batch():
    counts = np.array([50, 1, 1, 1, 1, 40, 3])
    for n in (1, 2, 3, 7, 9):
        groups = microbatching.split_contiguous(counts, n)
        assert len(groups) == min(n, len(counts)) and all(len(g) for g in groups)
        assert np.concatenate(groups).tolist() == list(range(len(counts)))


def test_clustering_puts_sequences_that_share_keys_together():
    rng = np.random.default_rng(0)
    topics = [np.arange(100 * t, 100 * t + 100) for t in range(4)]
    order = rng.permutation(32)
    key_sets = [rng.choice(topics[i % 4], size=30, replace=False) for i in order]
    counts = np.full(32, 30)
    plain = microbatching.split_contiguous(counts, 4)
    grouped = microbatching.cluster_by_keys(key_sets, counts, 4)
    assert sorted(np.concatenate(grouped).tolist()) == list(range(32))
    assert all(len(g) for g in grouped)
    assert sum(microbatching.unique_keys(grouped, key_sets)) < 0.6 * sum(microbatching.unique_keys(plain, key_sets))


def test_step_generators_are_a_pure_function_of_their_key():
    a = torch.randint(0, 10**6, (5,), generator=step_generator(0, "negatives", 7, 1))
    b = torch.randint(0, 10**6, (5,), generator=step_generator(0, "negatives", 7, 1))
    c = torch.randint(0, 10**6, (5,), generator=step_generator(0, "negatives", 7, 0))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_host_offload_keeps_negatives_in_fp16_and_positives_exact():
    off = HostOffload(torch.device("cpu"), fp16=True)
    rows = torch.randn(4, 3)
    pos_slot, neg_slot = off.park(rows), off.park(rows, half=True)
    assert torch.equal(off.take(pos_slot), rows)
    got = off.take(neg_slot)
    assert got.dtype == torch.float32 and torch.allclose(got, rows, atol=1e-2) and not torch.equal(got, rows)


def _cfg(**kw):
    tree = {"data": {"max_len": 12}, "model": {"d_model": 8, "num_heads": 2, "dqk": 4, "dv": 4},
            "loss": {"negatives": 5, "ranking_candidates": 3}, "train": {"batch_size": 16, "epochs": 2}}
    for dotted, v in kw.items():
        sec, key = dotted.split("__")
        tree.setdefault(sec, {})[key] = v
    return Config.model_validate(tree)


def test_schedule_splits_every_global_batch_across_ranks_identically():
    split = LeaveOneOut(cyclic_dataset(num_users=50))
    cfg = _cfg()
    s = Schedule(split, cfg, world_size=2, ranking_candidates=3)
    rows = s.step_rows(0, 0)
    # same order as the single-process trainer
    assert np.array_equal(s.order(1), np.random.default_rng([0, 1]).permutation(len(split.train_users)))
    parts = s.parts(rows)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(rows)))
    assert s.total_steps() == sum(s.steps_in_epoch(e) for e in range(2))
    positions = list(s.positions(1, 0, s.steps_in_epoch(0)))
    assert positions[0] == (1, 0, s.steps_in_epoch(0)) and len(positions) == s.steps_in_epoch(1)


@pytest.mark.parametrize("sharing", ["batch", "group", "token"])
def test_prepared_micro_batches_cover_the_rank_batch_and_index_their_keys(sharing):
    split = LeaveOneOut(cyclic_dataset(num_users=50))
    cfg = _cfg(pipeline__microbatches=3, pipeline__cluster=True, loss__sharing=sharing, loss__group_size=4,
               negatives__fp16=True)
    s = Schedule(split, cfg, world_size=2, ranking_candidates=3)
    prep = Preparer(s, cfg, rank=1, num_items=split.ds.num_items, num_tasks=1, ranking=True)
    b = prep(0, 1, 1)
    assert len(b.micro) == 3 and sum(m.num_seqs for m in b.micro) == b.local_seqs
    assert sum(m.num_tokens for m in b.micro) == b.local_tokens
    for m in b.micro:
        keys = b.units[m.unit].keys
        assert torch.equal(keys[m.inv_input], m.full.item_ids)
        assert torch.equal(keys[m.inv_target], m.targets)
        if sharing != "batch":
            assert torch.equal(keys[m.inv_neg], m.neg_ids)
            assert m.neg_group.numel() == m.num_tokens and int(m.neg_group.max()) < m.neg_ids.shape[0]
    if sharing == "batch":
        unit = b.units[b.neg_unit]
        assert unit.n_full == 0 and torch.equal(unit.keys[b.inv_batch_neg], b.batch_neg_ids)
    again = prep(0, 1, 1)
    assert torch.equal(again.micro[0].full.item_ids, b.micro[0].full.item_ids)
    for background in (True, False):
        stream = BatchStream(iter([(0, 0, 0), (0, 1, 1)]), prep, depth=1, background=background)
        first = stream.next()
        assert stream.peek().global_step == 1 and first.global_step == 0
        assert stream.next().global_step == 1 and stream.next() is None
        assert torch.equal(first.micro[0].full.item_ids, prep(0, 0, 0).micro[0].full.item_ids)


def test_clustering_lowers_unique_keys_on_topical_synthetic_data():
    ds = synthesize("tiny", seed=0)
    split = LeaveOneOut(ds)
    base = {"data__max_len": 64, "train__batch_size": 64, "pipeline__microbatches": 4}
    keys = {}
    for clustered in (False, True):
        cfg = _cfg(**base, pipeline__cluster=clustered)
        s = Schedule(split, cfg, world_size=2, ranking_candidates=0)
        prep = Preparer(s, cfg, rank=0, num_items=ds.num_items, num_tasks=1, ranking=False)
        keys[clustered] = np.mean([np.mean(prep(0, i, i).mb_unique_keys) for i in range(3)])
    assert keys[True] < keys[False]

"""Vectorised key-centric clustering: the same partition as the set-based reference, its guarantees (n
non-empty micro-batches, token slack, never more unique keys than the contiguous split, deterministic), exact
key counts, and the Preparer's key sets."""

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset

from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.train import microbatching as mb
from grstack.runtime.train.batching import Preparer, Schedule
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit


def _zipf_key_sets(rng, m, max_size, vocab, topics=1, scale=1):
    """Sequences of Zipf item ids (popular items shared), optionally drawn from separate topics."""
    out = []
    for _ in range(m):
        t = int(rng.integers(0, topics))
        k = rng.zipf(1.4, int(rng.integers(0, max_size + 1))) % vocab + t * vocab
        out.append(k.astype(np.int64) * scale)
    return out


def _brute_unique(groups, key_sets):
    return [len(set().union(*(set(key_sets[i].tolist()) for i in g))) for g in groups]


def _check_partition(groups, m, n):
    assert len(groups) == max(1, min(n, m))
    assert all(len(g) for g in groups) or m == 0
    assert sorted(np.concatenate(groups).tolist()) == list(range(m))


def _case(rng, big_ids=False):
    m = int(rng.integers(1, 45))
    n = int(rng.integers(1, 7))
    key_sets = _zipf_key_sets(rng, m, 40, int(rng.integers(5, 300)), topics=int(rng.integers(1, 5)),
                              scale=10**12 + 7 if big_ids else 1)
    counts = rng.integers(1, 80, m)
    return key_sets, counts, n


@pytest.mark.parametrize("big_ids", [False, True])  # bitmap path / sort path of the incidence
def test_fast_clustering_returns_the_reference_partition(big_ids):
    rng = np.random.default_rng(1 + big_ids)
    for _ in range(80):
        key_sets, counts, n = _case(rng, big_ids)
        fast = mb.cluster_by_keys(key_sets, counts, n)
        ref = mb.cluster_by_keys_reference(key_sets, counts, n)
        assert [g.tolist() for g in fast] == [g.tolist() for g in ref]


def test_fast_clustering_matches_with_many_sequences_and_many_micro_batches():
    rng = np.random.default_rng(3)
    # over 64 sequences: holder masks of two words; over PATTERN_GROUPS micro-batches: the count-based greedy
    for m, n in ((130, 3), (90, 5), (40, mb.PATTERN_GROUPS + 3)):
        key_sets = _zipf_key_sets(rng, m, 25, 150, topics=3)
        counts = rng.integers(1, 50, m)
        fast = mb.cluster_by_keys(key_sets, counts, n)
        assert [g.tolist() for g in fast] == [g.tolist() for g in mb.cluster_by_keys_reference(key_sets, counts, n)]


def test_clustering_guarantees():
    rng = np.random.default_rng(4)
    slack = 0.15
    for trial in range(60):
        key_sets, counts, n = _case(rng, big_ids=trial % 3 == 0)
        if trial % 2:  # many short sequences: every micro-batch within the slack
            counts = rng.integers(1, 4, len(key_sets))
        groups = mb.cluster_by_keys(key_sets, counts, n, slack=slack)
        m = len(key_sets)
        _check_partition(groups, m, n)
        n_eff = len(groups)
        loads = [int(counts[g].sum()) for g in groups]
        total = int(counts.sum())
        bound = max((1 + slack) * total / n_eff, total / n_eff + int(counts.max()))
        assert max(loads) <= bound + 1e-9
        if int(counts.max()) <= slack * total / n_eff:
            assert max(loads) <= (1 + slack) * total / n_eff + 1e-9
        plain = mb.split_contiguous(counts, n)
        assert sum(mb.unique_keys(groups, key_sets)) <= sum(mb.unique_keys(plain, key_sets))
        again = mb.cluster_by_keys([k.copy() for k in key_sets], counts.copy(), n, slack=slack)
        assert [g.tolist() for g in again] == [g.tolist() for g in groups]


def test_edge_cases():
    assert [g.tolist() for g in mb.cluster_by_keys([], np.zeros(0), 4)] == [[]]
    empty = [np.zeros(0, np.int64)] * 5
    groups = mb.cluster_by_keys(empty, np.array([3, 1, 2, 5, 1]), 3)
    _check_partition(groups, 5, 3)
    groups = mb.cluster_by_keys([np.array([7, 7, 7]), np.array([7])], np.array([1, 1]), 4)
    _check_partition(groups, 2, 2)
    assert mb.unique_keys(groups, [np.array([7, 7, 7]), np.array([7])]) == [1, 1]


def test_key_counts_equal_a_brute_force_count():
    rng = np.random.default_rng(5)
    for trial in range(40):
        key_sets, counts, n = _case(rng, big_ids=trial % 2 == 1)
        key_sets = [np.concatenate([k, k[: len(k) // 2]]) for k in key_sets]  # duplicates inside a sequence
        for groups in (mb.split_contiguous(counts, n), mb.cluster_by_keys(key_sets, counts, n)):
            brute = _brute_unique(groups, key_sets)
            assert mb.unique_keys(groups, key_sets) == brute
            inc = mb.KeyIncidence.of(key_sets)
            assert inc.total(inc.counts([g.tolist() for g in groups])) == sum(brute)
            every = set().union(*(set(k.tolist()) for k in key_sets)) if key_sets else set()
            assert inc.single + int(inc.weight.sum()) == len(every)


@pytest.mark.parametrize("scale", [1, 10**12, 10**14])  # ids in a small range (bitmap), spread out (sort), huge (ranked)
def test_the_vectorised_path_runs_at_kuairand_scale(monkeypatch, scale):
    """32 sequences, heavy-tailed up to 4,096 tokens, ~34 keys per token (group-shared negatives): the set-based
    reference is never called."""

    def refuse(*args, **kwargs):
        raise AssertionError("the set-based clustering ran")

    for name in ("cluster_by_keys_reference", "_greedy", "_refine"):
        monkeypatch.setattr(mb, name, refuse)
    rng = np.random.default_rng(6)
    lengths = np.minimum(rng.lognormal(np.log(450), 1.0, 32).astype(np.int64) + 20, 4096)
    lengths[0] = 4096
    per_set, R, items = 16, 512, 40_000
    tokens = int(lengths.sum())
    negs = rng.integers(1, items + 1, (-(-tokens // per_set), R))
    off = np.r_[0, np.cumsum(lengths)]
    ids = (rng.zipf(1.3, tokens) % items + 1).astype(np.int64)
    key_sets = mb.sequence_key_sets(off, ids * scale, np.roll(ids, -1) * scale, None, negs * scale, per_set, [])
    assert sum(k.size for k in key_sets) > 30 * tokens
    groups = mb.cluster_by_keys(key_sets, lengths, 4)
    _check_partition(groups, 32, 4)
    assert sum(mb.unique_keys(groups, key_sets)) <= sum(mb.unique_keys(mb.split_contiguous(lengths, 4), key_sets))


def _cfg(**kw):
    tree = {"data": {"max_len": 12}, "model": {"d_model": 8, "num_heads": 2, "dqk": 4, "dv": 4},
            "loss": {"negatives": 5, "ranking_candidates": 3}, "train": {"batch_size": 16, "epochs": 2},
            "pipeline": {"microbatches": 3, "cluster": True}}
    for dotted, v in kw.items():
        sec, key = dotted.split("__")
        tree.setdefault(sec, {})[key] = v
    return Config.model_validate(tree)


@pytest.mark.parametrize(("sharing", "share_k"), [("batch", 1), ("group", 1), ("group", 2), ("token", 3)])
def test_key_sets_are_what_the_preparer_looks_up(sharing, share_k):
    """The key sets built for timing are the Preparer's: clustering them gives the Preparer's micro-batches,
    whose lookup units hold exactly the union of their sequences' keys."""
    split = LeaveOneOut(cyclic_dataset(num_users=50))
    cfg = _cfg(loss__sharing=sharing, loss__group_size=4, negatives__share_k=share_k)
    s = Schedule(split, cfg, world_size=2, ranking_candidates=3)
    prep = Preparer(s, cfg, rank=1, num_items=split.ds.num_items, num_tasks=1, ranking=True)
    for step in range(2):
        inputs, lengths, n = mb.rank_key_inputs(s, cfg, split.ds.num_items, 0, step, step, 1, True)
        key_sets = mb.sequence_key_sets(**inputs)
        groups = mb.cluster_by_keys(key_sets, lengths, n)
        b = prep(0, step, step)
        assert [m.num_seqs for m in b.micro] == [len(g) for g in groups]
        assert [m.num_tokens for m in b.micro] == [int(lengths[g].sum()) for g in groups]
        for m, g in zip(b.micro, groups, strict=True):
            keys = b.units[m.unit].keys
            assert set(keys.tolist()) == set(np.concatenate([key_sets[i] for i in g]).tolist())
            assert torch.equal(keys[m.inv_target], m.targets)
    stats = mb.cluster_time_per_batch(s, cfg, split.ds.num_items, rank=1, steps=2)
    assert stats["batches"] == 2 and stats["microbatches"] == n
    assert stats["cluster_ms_per_batch"] >= stats["clustering_ms_per_batch"] >= 0
    assert stats["unique_keys_total"]["clustered"] <= stats["unique_keys_total"]["contiguous"]

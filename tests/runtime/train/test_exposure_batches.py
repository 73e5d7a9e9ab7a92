"""Training batches for ranking on logged exposures (``loss.ranking_on=exposures``): each step draws a block of
every user's training events, the history stops right before it, its labels are the block's own action bits,
candidates carry no actions, and a step's draw is a function of the step (a resumed run draws the same)."""

import numpy as np
import pytest
import torch

from grstack.runtime.data import LeaveOneOut, from_sequences
from grstack.runtime.errors import UserError
from grstack.runtime.train.batching import Preparer, Schedule, rank_batch
from grstack.runtime.train.microbatching import rank_key_inputs
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit

K = 3


def _dataset(num_users: int = 24):
    """Item id 1000 * user + position, so a token says where it came from; actions vary by position."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(3 * K + 2, 40, num_users)
    items = [1000 * (u + 1) + np.arange(n) for u, n in enumerate(lengths)]
    acts = [(np.arange(n) * 3 + u) % 8 for u, n in enumerate(lengths)]
    ds = from_sequences(list(range(1, num_users + 1)), items, [np.arange(n) * 60 for n in lengths],
                        num_items=40_000, actions=acts, action_names=["click", "like", "long_view"])
    return ds, acts


def _cfg(**loss) -> Config:
    return Config.model_validate({
        "data": {"max_len": 12}, "model": {"d_model": 8, "num_heads": 2, "dqk": 4, "dv": 4},
        "loss": {"negatives": 5, "ranking_candidates": K, "ranking_on": "exposures", **loss},
        "train": {"batch_size": 8, "epochs": 2}, "pipeline": {"microbatches": 2}})


def test_a_step_ranks_a_drawn_block_after_the_history_before_it():
    ds, acts = _dataset()
    cfg = _cfg()
    split = LeaveOneOut(ds, block=cfg.ranking_block())
    s = Schedule(split, cfg, world_size=1, ranking_candidates=K)
    prep = Preparer(s, cfg, rank=0, num_items=ds.num_items, num_tasks=4, ranking=True)
    starts: dict[int, set[int]] = {}
    for step in range(6):
        b = prep(step // 3, step % 3, step)
        again = prep(step // 3, step % 3, step)
        for m, m2 in zip(b.micro, again.micro, strict=True):
            assert torch.equal(m.cand_ids, m2.cand_ids) and torch.equal(m.labels, m2.labels)
            full, is_hist = m.full, m.is_hist
            assert full.num_targets.tolist() == [K] * m.num_seqs
            assert (full.input_actions[~is_hist] == -1).all()  # candidates carry no action
            for i in range(m.num_seqs):
                lo, hi = int(full.offsets[i]), int(full.offsets[i + 1])
                hist = full.item_ids[lo : hi - K]
                user = int(hist[0]) // 1000 - 1
                pos = int(hist[-1]) % 1000 + 1 + np.arange(K)  # the block follows the last history event
                assert (full.item_ids[hi - K : hi] % 1000).tolist() == pos.tolist()
                assert pos[-1] < len(acts[user]) - 2 * K  # never a held-out event
                bits = acts[user][pos]
                for t in range(1, 4):
                    assert m.labels[i, :, t].tolist() == ((bits >> (t - 1)) & 1).tolist()
                starts.setdefault(user, set()).add(int(pos[0]))
    assert sum(len(v) > 1 for v in starts.values()) > len(starts) // 2  # blocks move between steps


def test_the_clustering_key_sets_see_the_preparers_candidates():
    ds, _ = _dataset()
    cfg = _cfg()
    split = LeaveOneOut(ds, block=cfg.ranking_block())
    s = Schedule(split, cfg, world_size=1, ranking_candidates=K)
    rows = s.step_rows(0, 1)
    _, _, cands, acts = rank_batch(split, rows, cfg, ds.num_items, True, 1, 0)
    inputs, _, _ = rank_key_inputs(s, cfg, ds.num_items, 0, 1, 1, 0, True)
    assert np.array_equal(inputs["cands"], cands.numpy()) and acts is not None


def test_a_dataset_without_actions_is_refused():
    ds, _ = _dataset()
    ds.actions, ds.action_names = None, []
    cfg = _cfg()
    s = Schedule(LeaveOneOut(ds, block=K), cfg, world_size=1, ranking_candidates=K)
    with pytest.raises(UserError, match="logged actions"):
        Preparer(s, cfg, rank=0, num_items=ds.num_items, num_tasks=1, ranking=True)

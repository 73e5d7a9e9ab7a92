"""The schedule over rank-local data: every rank fills each step to the same cost target from its own queue,
all ranks agree on the steps from the lengths alone, and every training row is used at most once an epoch."""

from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.data import RankShare, deal, list_pieces, write_dataset
from grstack.runtime.data.synth import synthesize
from grstack.runtime.train import balance
from grstack.runtime.train.shard_schedule import ShardSchedule, fill_by_cost, fill_by_count
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


def test_fill_by_cost_uses_each_position_once_and_balances_ranks_under_heavy_tails():
    rng = np.random.default_rng(0)
    costs = [balance.sequence_cost(np.minimum(rng.pareto(1.2, 3000) * 40 + 5, 4000), 1.0, 0.01) for _ in range(4)]
    target = 40 * np.mean(np.concatenate(costs))
    steps = fill_by_cost(costs, target)
    assert len({len(s) for s in steps}) == 1 and len(steps[0]) > 10
    for s in steps:
        used = np.concatenate(s)
        assert len(np.unique(used)) == len(used)
    per_step = np.array([[c[s[k]].sum() for c, s in zip(costs, steps, strict=True)] for k in range(len(steps[0]))])
    assert np.all(per_step.max(axis=1) >= target * 0.9)
    # ranks end each step near the same cost: the costliest row at a queue's head sets the step's target
    imbalance = [balance.imbalance(row) for row in per_step]
    assert np.median(imbalance) < 0.02 and np.mean(imbalance) < 0.05


def test_a_row_costlier_than_the_target_raises_the_steps_target_on_every_rank():
    steps = fill_by_cost([np.array([50.0, 1.0, 1.0]), np.array([10.0] * 8 + [1.0] * 3)], target=2.0)
    assert steps[0][0].tolist() == [0]
    assert steps[1][0].tolist() == [0, 1, 2, 3, 4]  # filled to 50, not to 2
    assert len(steps[0]) == len(steps[1])


def test_fill_by_count():
    assert [s.tolist() for s in fill_by_count(7, 3)] == [[0, 1, 2], [3, 4, 5]]


@pytest.fixture(scope="module")
def shares(tmp_path_factory):
    d = write_dataset(synthesize("tiny", seed=1), tmp_path_factory.mktemp("d") / "tiny", row_group_size=32)
    pieces = list_pieces(d, 2)
    parts = deal(pieces, 2)
    out = [RankShare(d, pieces, parts[r], min_len=3, max_len=50, has_actions=True) for r in range(2)]
    return d, out


@pytest.mark.parametrize("mode", ["tokens", "count"])
def test_every_rank_computes_the_same_steps_from_the_gathered_lengths(shares, mode):
    d, sh = shares
    cfg = load_config(CONFIG, [f"data.source={d}", "data.format=parquet", "data.read=shard", f"balance.mode={mode}",
                               "train.batch_size=32", "data.shuffle_window=2"])
    lengths = [s.lengths for s in sh]
    scheds = [ShardSchedule(sh[r], lengths, cfg, 2, r, 8) for r in range(2)]
    for epoch in (0, 1):
        assert scheds[0].steps_in_epoch(epoch) == scheds[1].steps_in_epoch(epoch) > 0
        seen = []
        for step in range(scheds[0].steps_in_epoch(epoch)):
            rows = [s.step_rows(epoch, step) for s in scheds]
            assert np.array_equal(rows[0], rows[1])
            parts = scheds[0].parts(rows[0])
            for r in range(2):  # a rank's part is its own rows only
                own = scheds[r].own_rows()
                assert np.all(np.isin(rows[0][parts[r]], own)) and len(parts[r]) > 0
            if mode == "count":
                assert [len(p) for p in parts] == [16, 16]
            seen.append(rows[0])
        seen = np.concatenate(seen)
        assert len(np.unique(seen)) == len(seen)
        assert len(seen) + scheds[0].dropped[epoch] == len(scheds[0].lengths)
    assert not np.array_equal(scheds[0].step_rows(0, 0), scheds[0].step_rows(1, 0))


def test_token_balanced_steps_have_near_equal_cost_per_rank(shares):
    d, sh = shares
    cfg = load_config(CONFIG, [f"data.source={d}", "data.format=parquet", "data.read=shard", "balance.mode=tokens",
                               "train.batch_size=32"])
    s = ShardSchedule(sh[0], [x.lengths for x in sh], cfg, 2, 0, 8)
    balanced = [balance.imbalance(s.costs(s.step_rows(0, k), s.parts(s.step_rows(0, k))))
                for k in range(s.steps_in_epoch(0))]
    counted = [balance.imbalance(s.costs(s.step_rows(0, k), s.parts(s.step_rows(0, k), "count")))
               for k in range(s.steps_in_epoch(0))]
    assert np.mean(balanced) < 0.5 * np.mean(counted)

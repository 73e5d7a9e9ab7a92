"""The learning rate of each optimizer update and the updates of a run: warm-up, constant / cosine / linear
decay to ``min_lr_ratio * lr`` at the last update, and gradient-accumulation windows."""

import math
from itertools import pairwise

import pytest

from grstack.runtime.train.lr_schedule import count_updates, learning_rate, window_bounds
from grstack.runtime.training_config import OptimConfig

pytestmark = pytest.mark.unit

LR = 0.004


def _rates(total: int, **kw) -> list[float]:
    o = OptimConfig(lr=LR, **kw)
    return [learning_rate(u, total, o) for u in range(total)]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_warm_up_is_linear_from_lr_over_warmup_to_lr(schedule):
    warmup = 5
    rates = _rates(40, warmup_steps=warmup, schedule=schedule, min_lr_ratio=0.1)
    for u in range(warmup):
        assert rates[u] == pytest.approx(LR * (u + 1) / warmup, rel=1e-12)
    assert rates[0] == pytest.approx(LR / warmup)
    assert rates[warmup - 1] == pytest.approx(LR)
    # strictly increasing during warm-up, by equal increments
    steps = [b - a for a, b in pairwise(rates[:warmup])]
    assert all(s == pytest.approx(LR / warmup) for s in steps)


def test_constant_stays_lr():
    assert _rates(30) == [LR] * 30
    rates = _rates(30, warmup_steps=3, min_lr_ratio=0.5)  # min_lr_ratio does not apply to constant
    assert rates[3:] == [LR] * 27


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 4])
@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_decay_from_lr_to_the_floor_at_the_last_update(schedule, warmup, min_ratio):
    total = warmup + 21  # the decay spans 20 updates (warmup .. total-1): its midpoint is an update
    rates = _rates(total, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_ratio)
    assert rates[warmup] == pytest.approx(LR, rel=1e-12)  # right after warm-up: the full rate
    assert rates[total - 1] == pytest.approx(min_ratio * LR, abs=1e-15)  # exactly the floor at the end
    assert min(rates[warmup:]) == rates[total - 1]
    decay = rates[warmup:]
    assert all(b <= a for a, b in pairwise(decay)), decay  # non-increasing
    assert decay[0] > decay[-1]
    mid = warmup + 10
    assert rates[mid] == pytest.approx(LR * (min_ratio + (1 - min_ratio) / 2), rel=1e-12)
    # past the last update (never asked for by the trainer) the rate stays at the floor
    o = OptimConfig(lr=LR, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_ratio)
    assert learning_rate(total + 3, total, o) == pytest.approx(min_ratio * LR, abs=1e-15)


def test_cosine_and_linear_have_their_shapes():
    total = 41
    cos = _rates(total, schedule="cosine", min_lr_ratio=0.2)
    lin = _rates(total, schedule="linear", min_lr_ratio=0.2)
    for u in range(total):
        p = u / (total - 1)
        assert lin[u] == pytest.approx(LR * (0.2 + 0.8 * (1 - p)), rel=1e-12)
        assert cos[u] == pytest.approx(LR * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p))), rel=1e-12)
    # cosine decays slower than linear in the first half and faster in the second
    assert cos[10] > lin[10] and cos[30] < lin[30]


def test_window_bounds():
    # epochs of 13 batches, windows of 2: [0,2) [2,4) ... [10,12) and a short [12,13)
    assert window_bounds(0, 13, 2) == (0, 2)
    assert window_bounds(1, 13, 2) == (0, 2)
    assert window_bounds(5, 13, 2) == (4, 6)
    assert window_bounds(11, 13, 2) == (10, 12)
    assert window_bounds(12, 13, 2) == (12, 13)  # the epoch's last window is shorter
    # windows of 3 over 7 batches
    assert [window_bounds(s, 7, 3) for s in range(7)] == [(0, 3)] * 3 + [(3, 6)] * 3 + [(6, 7)]
    # no accumulation: every batch is its own window
    assert [window_bounds(s, 4, 1) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a window larger than the epoch: one window, cut at the epoch's end
    assert window_bounds(2, 3, 8) == (0, 3)


def test_count_updates():
    assert count_updates([13], 2) == 7  # six full windows and one of a single batch
    assert count_updates([13, 13, 13], 2) == 21  # windows never cross an epoch
    assert count_updates([13, 13], 1) == 26
    assert count_updates([13, 12], 2) == 7 + 6
    assert count_updates([5], 8) == 1
    # max_batches cutting inside a window still counts that window (the cut window updates)
    assert count_updates([13, 13], 2, max_batches=5) == 3  # [0,2) [2,4) [4,5)
    assert count_updates([13, 13], 2, max_batches=4) == 2
    assert count_updates([13, 13], 2, max_batches=15) == 7 + 1  # epoch 1 cut after 2 batches: one window
    assert count_updates([13, 13], 2, max_batches=16) == 7 + 2  # ... after 3 batches: a cut second window
    assert count_updates([13, 13], 3, max_batches=13) == 5  # exactly one epoch
    assert count_updates([13, 13], 3, max_batches=100) == 10  # more than the run has: the whole run
    assert count_updates([], 2) == 0

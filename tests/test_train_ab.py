"""``bench/train_ab.py``'s arithmetic: each moment of communication counted once, the part of it the training
thread was blocked for, and paired ratios with a bootstrap interval that says "no worse" only when it
should."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_SPEC = importlib.util.spec_from_file_location("train_ab", Path(__file__).resolve().parents[1] / "bench" / "train_ab.py")
assert _SPEC is not None and _SPEC.loader is not None
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)


def test_union_counts_each_moment_once():
    assert ab.union_length([]) == 0.0
    assert ab.union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == pytest.approx(4.0)


def test_covered_is_the_blocked_part_of_the_union():
    events = [(0.0, 4.0), (1.0, 2.0), (10.0, 12.0)]  # union 0-4, 10-12
    blocked = [(1.5, 3.0), (2.5, 5.0), (11.0, 20.0)]  # union 1.5-5, 11-20
    assert ab.covered(events, blocked) == pytest.approx(2.5 + 1.0)
    assert ab.covered(events, []) == 0.0
    assert ab.covered(events, [(-1.0, 100.0)]) == pytest.approx(ab.union_length(events))


def test_paired_ratio_interval_and_verdict():
    same = ab.paired([10.0, 12.0, 11.0, 9.0], [10.0, 12.0, 11.0, 9.0])
    assert same["ratio"] == pytest.approx(1.0) and same["ci95"][0] == pytest.approx(1.0) and same["no_worse"]
    worse = ab.paired([12.0, 13.2, 12.1, 11.0], [10.0, 11.0, 10.0, 9.0])
    assert worse["ratio"] == pytest.approx(math.exp(sum(math.log(r) for r in (1.2, 1.2, 1.21, 11 / 9)) / 4))
    assert worse["ci95"][0] > 1.0 and not worse["no_worse"]
    noisy = ab.paired([8.0, 12.0, 9.0, 13.0], [10.0, 10.0, 10.0, 10.0])
    assert noisy["ci95"][0] < 1.0 < noisy["ci95"][1] and noisy["no_worse"]

"""Limits by bisection with intervals: the rules the simulator's verdicts follow, on synthetic knees."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from grstack.runtime.bench.serve_sim_limits import (
    LimitResult,
    find_limit,
    limit_of,
    p99_interval,
    plan_capacity,
    separated,
    versus,
)

pytestmark = pytest.mark.unit
SLO = 100.0


def knee(at: float, width: float = 0.0):
    """A point whose P99 crosses the SLO at ``at`` (its interval +-width around it)."""
    async def measure(v: float) -> dict:
        p99 = SLO * v / at
        return {"v": v, "p99_ms": p99, "p99_ms_lo": p99 - width, "p99_ms_hi": p99 + width}
    return measure


def test_p99_interval_is_the_pooled_higher_percentile_and_covers_the_truth() -> None:
    rng = np.random.default_rng(1)
    truth = float(np.exp(1.0 + 0.5 * 2.3263))  # lognormal(1, 0.5)'s 99th percentile
    covered = 0
    for trial in range(40):
        groups = [rng.lognormal(1.0, 0.5, 1500) for _ in range(2)]
        p, lo, hi = p99_interval(groups, rng=np.random.default_rng(trial))
        assert p == float(np.percentile(np.concatenate(groups), 99, method="higher"))
        assert lo <= p <= hi
        covered += lo <= truth <= hi
    assert covered >= 32  # a 95 % interval: 38 of 40 expected, a wide margin for the test's own chance


def test_failures_are_above_any_slo() -> None:
    groups = [[10.0] * 95 + [math.inf] * 5]
    p, _, hi = p99_interval(groups)
    assert p == math.inf and hi == math.inf


def test_find_limit_brackets_the_knee_within_five_percent() -> None:
    res = asyncio.run(find_limit(knee(137.0), 40.0, slo_ms=SLO, key="v", resolution=0.05, floor=1.0, ceiling=1e4))
    assert res.limit is not None and res.bracket[1] is not None
    assert res.limit <= 137.0 < res.bracket[1]
    assert res.bracket[1] / res.limit <= 1.05 + 1e-9
    assert len(res.points) <= 12
    assert not res.lower_bound_only


def test_find_limit_from_above_and_integer_values() -> None:
    res = asyncio.run(find_limit(knee(700.0), 4096, slo_ms=SLO, key="v", floor=256, ceiling=50_000, integer=True))
    assert res.limit is not None and res.limit <= 700 < res.bracket[1]
    assert all(float(p["v"]).is_integer() for p in res.points)


def test_floor_failing_gives_no_limit_and_ceiling_passing_a_lower_bound() -> None:
    none = asyncio.run(find_limit(knee(1.0), 64.0, slo_ms=SLO, key="v", floor=8.0))
    assert none.limit is None
    top = asyncio.run(find_limit(knee(1e9), 64.0, slo_ms=SLO, key="v", ceiling=512.0))
    assert top.limit == 512.0 and top.lower_bound_only


def test_interval_ends_are_the_certain_pass_and_certain_fail() -> None:
    pts = [{"v": v, "p99_ms": p, "p99_ms_lo": p - 10, "p99_ms_hi": p + 10}
           for v, p in ((10, 50.0), (20, 85.0), (30, 95.0), (40, 105.0), (50, 130.0))]
    res = limit_of(pts, "v", SLO)
    assert res.limit == 30 and res.bracket == (30, 40)
    assert res.ci95 == (20, 50)  # 30 and 40 could each be on either side under resampling


def test_points_that_gave_up_above_the_limit_are_settled_whole_until_one_certainly_fails() -> None:
    # a point that stopped sending has a lower bound of 0 (its unsent ranks could have been fast); measured
    # whole, the same point's interval is its own
    settled: list[float] = []

    async def measure(v: float) -> dict:
        p99 = SLO * v / 30
        return {"v": v, "p99_ms": p99, "p99_ms_hi": p99 + 5, "whole": p99 <= SLO,
                "p99_ms_lo": p99 - 5 if p99 <= SLO else 0.0}

    async def whole(v: float) -> dict:
        settled.append(v)
        p99 = SLO * v / 30
        return {"v": v, "p99_ms": p99, "p99_ms_lo": p99 - 5, "p99_ms_hi": p99 + 5, "whole": True}

    bare = asyncio.run(find_limit(measure, 10, slo_ms=SLO, key="v"))
    assert bare.ci95[1] is None  # nothing certainly fails
    res = asyncio.run(find_limit(measure, 10, slo_ms=SLO, key="v", settle=whole))
    assert res.limit == bare.limit and 28.5 <= res.limit <= 30
    assert settled == sorted(settled) and settled[0] > res.limit and len(settled) <= 3
    assert res.ci95[1] == settled[-1] and res.ci95[1] * SLO / 30 - 5 > SLO  # the first value certainly failing


def test_a_noisy_pass_above_a_failure_does_not_raise_the_limit() -> None:
    pts = [{"v": v, "p99_ms": p, "p99_ms_lo": p, "p99_ms_hi": p} for v, p in ((10, 50.0), (20, 120.0), (30, 90.0))]
    assert limit_of(pts, "v", SLO).limit == 10


def test_ratio_interval_and_separation() -> None:
    a = LimitResult(60.0, (60.0, 63.0), (50.0, 70.0))
    b = LimitResult(20.0, (20.0, 21.0), (18.0, 25.0))
    r = versus(a, b)
    assert r["ratio"] == pytest.approx(3.0)
    assert r["ci95"] == [pytest.approx(2.0), pytest.approx(70 / 18)]
    assert separated((18.0, 25.0), (50.0, 70.0)) and not separated((18.0, 55.0), (50.0, 70.0))
    assert not separated((18.0, None), (50.0, 70.0))
    assert versus(a, LimitResult(None, (None, 8.0), (None, 8.0)))["ratio"] is None


def test_plan_finds_the_fewest_replicas() -> None:
    async def meets(replicas: int, device: float) -> bool:
        return replicas * device >= 13.0  # more memory per replica, fewer replicas

    plans = asyncio.run(plan_capacity(meets, [1.0, 2.0, 100.0], max_replicas=64))
    assert [p["replicas"] for p in plans] == [13, 7, 1]
    assert asyncio.run(plan_capacity(meets, [0.1], max_replicas=64))[0]["replicas"] is None

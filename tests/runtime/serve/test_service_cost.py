"""The in-service cost factor: a ranker's recent single-user steps against what its start-up profile predicts."""

from __future__ import annotations

import pytest

from grstack.runtime.serve.service_cost import SERVICE_COST_BOUNDS, profiled_ms, service_cost_factor
from grstack.runtime.serve.step_log import StepLog, StepRecord
from grstack.runtime.serve.trigger import LatencyModel

pytestmark = pytest.mark.unit

# full(L) = L / 10 ms, cached 1 ms, prefill(L) = L / 20 ms between 100 and 2000 tokens
MODEL = LatencyModel(lengths=(100, 2000), full_ms=(10.0, 200.0), cached_ms=(1.0, 1.0), prefill_ms=(5.0, 100.0),
                     kv_bytes_per_token=8)
SUFFIX = 80  # the profile's short-term events and candidates


def steps(*specs: tuple[str, list[int], list[int], float]) -> list[StepRecord]:
    log = StepLog(64)
    for kind, new, context, seconds in specs:
        log.step(0.0, kind, new, context, seconds)
    return log.steps.last(64)


def test_each_kind_is_predicted_at_its_own_size() -> None:
    assert profiled_ms(MODEL, "rank_full", 1000 + SUFFIX, 0, SUFFIX) == pytest.approx(100.0)
    assert profiled_ms(MODEL, "rank_cached", 80, 1000, SUFFIX) == pytest.approx(1.0)
    assert profiled_ms(MODEL, "extend_many", 1000, 0, SUFFIX) == pytest.approx(50.0)
    assert profiled_ms(MODEL, "extend_many", 20, 1000, SUFFIX) is None  # an incremental extend: no curve for it


def test_the_factor_is_measured_over_profiled_time_of_single_user_steps() -> None:
    """A full ranking at 1000 tokens (profiled 100 ms) took 0.3 s, a prefill of 1000 (50 ms) 0.1 s, a cached
    ranking (1 ms) 3 ms: 403 / 151 ms. A batch of two and an incremental extend are left out."""
    got = steps(("rank_full", [1000 + SUFFIX], [0], 0.3), ("extend_many", [1000], [0], 0.1),
                ("rank_cached", [SUFFIX], [1000], 0.003),
                ("rank_cached", [SUFFIX, SUFFIX], [1000, 1000], 5.0), ("extend_many", [10], [1000], 5.0))
    assert service_cost_factor(got, MODEL, SUFFIX, min_steps=3) == pytest.approx(403.0 / 151.0)
    assert service_cost_factor(got, MODEL, SUFFIX, min_steps=4) is None  # too few single-user steps to say


def test_the_factor_is_clipped() -> None:
    stalled = steps(*[("rank_cached", [SUFFIX], [1000], 1.0)] * 4)  # 1 s for a 1 ms step
    assert service_cost_factor(stalled, MODEL, SUFFIX, min_steps=1) == SERVICE_COST_BOUNDS[1]
    fast = steps(*[("rank_cached", [SUFFIX], [1000], 1e-6)] * 4)
    assert service_cost_factor(fast, MODEL, SUFFIX, min_steps=1) == SERVICE_COST_BOUNDS[0]


def test_ring_last_returns_the_newest_records_oldest_first() -> None:
    log = StepLog(4)
    for k in range(6):
        log.step(float(k), "rank_cached", [1], [k], 0.0)
    assert [s.t for s in log.steps.last(3)] == [3.0, 4.0, 5.0]
    assert [s.t for s in log.steps.last(10)] == [2.0, 3.0, 4.0, 5.0]
    assert log.steps.last(0) == []

"""The trigger's budgets at scale refuse where they should, on virtual time: the footprint of prefixes that
must be resident in device memory (device capacity only; held while a routed rank still reads it), and the
load budget on a ranker busy enough that pre-inference competes with ranks (charged in full however many
signals are followed)."""

from __future__ import annotations

import pytest

from grstack.runtime.serve.clock import ManualClock
from grstack.runtime.serve.trigger import LatencyModel, SequenceAwareTrigger, TriggerConfig

pytestmark = pytest.mark.unit

# full(L) = L / 10 ms, prefill 10 ms, 100 B/token: a 1000-token prefix is at risk and holds 100,000 B.
MODEL = LatencyModel(lengths=(100, 2000), full_ms=(10.0, 200.0), cached_ms=(1.0, 1.0), prefill_ms=(10.0, 10.0),
                     kv_bytes_per_token=100)
PREFIX = 1000


def trigger(clock: ManualClock, **cfg: object) -> SequenceAwareTrigger:
    base = {"slo_ms": 100.0, "risk_fraction": 0.5, "cache_budget_bytes": 10**9, "prefill_budget_ms": 10**6}
    return SequenceAwareTrigger(MODEL, TriggerConfig(**{**base, **cfg}), clock=clock)


def busy_reports(t: SequenceAwareTrigger, clock: ManualClock, replica: str, busy: float,
                 **capacity: int) -> None:
    """Two stats reports 1 s apart: compute grew by ``busy`` x 1000 ms, a tenth of it prefill."""
    t.report(replica, {"compute_ms_total": {"prefill": 0.0, "rank_full": 0.0}, **capacity})
    clock.advance(1.0)
    t.report(replica, {"compute_ms_total": {"prefill": 100.0 * busy, "rank_full": 900.0 * busy}, **capacity})


def test_a_device_footprint_refuses_what_device_plus_dram_would_admit() -> None:
    caps = {"device_capacity_bytes": 200_000, "dram_capacity_bytes": 10**9}  # 50% of the device: one prefix
    for tier, second in (("cache", "admitted"), ("device", "cache-budget")):
        clock = ManualClock(1000.0)
        t = trigger(clock, footprint_tier=tier, ranker_cache_fraction=0.5)
        busy_reports(t, clock, "r1", 0.0, **caps)
        assert t.decide("a", "v", PREFIX, "r1").reason == "admitted"
        assert t.decide("b", "v", PREFIX, "r1").reason == second
    t.consumed("a")  # a's rank was routed: its device room is free again
    assert t.decide("b", "v", PREFIX, "r1").reason == "admitted"


def test_a_routed_ranks_prefix_stays_charged_for_the_hold() -> None:
    clock = ManualClock(1000.0)
    t = trigger(clock, cache_budget_bytes=100_000, footprint_hold_s=2.0)  # one prefix, router-wide
    assert t.decide("a", "v", PREFIX).admitted
    t.consumed("a")
    assert t.live_bytes == 100_000
    assert t.decide("b", "v", PREFIX).reason == "cache-budget"
    assert t.decide("a", "v", PREFIX).reason == "live"  # a repeat signal neither recharges nor extends it
    clock.advance(1.999)
    assert t.decide("b", "v", PREFIX).reason == "cache-budget"
    clock.advance(0.001)
    assert t.live_bytes == 0
    assert t.decide("b", "v", PREFIX).reason == "admitted"
    assert t.decide("a", "v", PREFIX).reason == "live"  # served: still presumed cached, uncharged


def test_without_a_hold_the_routed_prefix_is_released_at_once() -> None:
    clock = ManualClock(1000.0)
    t = trigger(clock, cache_budget_bytes=100_000)
    assert t.decide("a", "v", PREFIX).admitted
    t.consumed("a")
    assert t.live_bytes == 0 and t.decide("b", "v", PREFIX).admitted


@pytest.mark.parametrize(("busy", "threshold", "reason"), [
    (0.9, None, "admitted"),  # today's rule: every signal followed, nothing charged
    (0.9, 0.8, "load-budget"),  # busy past the threshold: charged in full, over budget
    (0.5, 0.8, "admitted"),  # not contended: the speculative share (0) is charged
])
def test_the_load_budget_binds_on_a_contended_ranker_even_when_every_signal_is_followed(
        busy: float, threshold: float | None, reason: str) -> None:
    clock = ManualClock(1000.0)
    # measured prefill over the 1 s window: 100 x busy ms; the budget is that plus one 10 ms prefill
    budget = 100.0 * busy + 10.0
    t = trigger(clock, window_s=1.0, ranker_prefill_budget_ms=budget, report_interval_s=1.0, follow_window=4,
                follow_min_samples=1, contended_busy_fraction=threshold)
    busy_reports(t, clock, "r1", busy)
    assert t.decide("u0", "v", PREFIX, "r1").reason == "admitted"  # charged in full: nothing known yet
    t.consumed("u0")
    assert t.speculative_share == 0.0
    assert t.decide("u1", "v", PREFIX, "r1").reason == reason


@pytest.mark.parametrize("bad", [{"footprint_tier": "hbm"}, {"footprint_hold_s": -1.0},
                                 {"contended_busy_fraction": 1.5}])
def test_budget_settings_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        TriggerConfig(**bad)  # type: ignore[arg-type]

"""The sequence-aware trigger admits and rejects exactly at its risk threshold and budget edges."""

from __future__ import annotations

import math

import pytest

from grstack.runtime.serve.trigger import LatencyModel, SequenceAwareTrigger, TriggerConfig

pytestmark = pytest.mark.unit

# Measured at 100 and 2000 tokens: full(L) = L / 10 ms in between, cached 1 ms, prefill 10 ms; 100 B/token.
MODEL = LatencyModel(lengths=(100, 2000), full_ms=(10.0, 200.0), cached_ms=(1.0, 1.0), prefill_ms=(10.0, 10.0),
                     kv_bytes_per_token=100)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def trigger(clock: Clock | None = None, **cfg: object) -> SequenceAwareTrigger:
    base = {"slo_ms": 100.0, "risk_fraction": 0.5, "cache_budget_bytes": 10**9, "prefill_budget_ms": 10**6}
    return SequenceAwareTrigger(MODEL, TriggerConfig(**{**base, **cfg}), clock=clock or Clock())


def test_at_risk_exactly_above_the_latency_threshold() -> None:
    t = trigger()  # threshold: full(L) > 50 ms, i.e. L > 500
    assert t.decide("a", "h", 500).reason == "not-at-risk"
    d = t.decide("b", "h", 501)
    assert d.admitted and d.reason == "admitted" and d.predicted_full_ms == pytest.approx(50.1)


def test_length_threshold_overrides_the_latency_model() -> None:
    t = trigger(length_threshold=64)
    assert t.decide("a", "h", 63).reason == "not-at-risk"
    assert t.decide("b", "h", 64).admitted


@pytest.mark.parametrize(("budget", "admitted"), [(3 * 1000 * 100, 3), (3 * 1000 * 100 - 1, 2)])
def test_cache_footprint_budget_edge(budget: int, admitted: int) -> None:
    t = trigger(cache_budget_bytes=budget)
    decisions = [t.decide(f"u{i}", "h", 1000) for i in range(4)]
    assert [d.admitted for d in decisions] == [True] * admitted + [False] * (4 - admitted)
    assert decisions[admitted].reason == "cache-budget"
    assert t.live_bytes == admitted * 100_000


@pytest.mark.parametrize(("budget", "admitted"), [(30.0, 3), (29.999, 2)])
def test_prefill_load_budget_edge(budget: float, admitted: int) -> None:
    clock = Clock()
    t = trigger(clock, prefill_budget_ms=budget, window_s=1.0)
    decisions = [t.decide(f"u{i}", "h", 1000) for i in range(4)]
    assert [d.admitted for d in decisions] == [True] * admitted + [False] * (4 - admitted)
    assert decisions[admitted].reason == "load-budget"
    clock.t = 1000.999  # still inside the window
    assert t.decide("late", "h", 1000).reason == "load-budget"
    clock.t = 1001.0  # the first admissions leave the window
    assert t.decide("late", "h", 1000).admitted


def test_a_live_prefix_is_admitted_again_without_a_second_charge() -> None:
    t = trigger(cache_budget_bytes=100_000, prefill_budget_ms=10.0)
    assert t.decide("a", "h1", 1000).reason == "admitted"
    again = t.decide("a", "h1", 1000)
    assert again.admitted and again.reason == "live"
    assert t.live_bytes == 100_000 and t.window_load_ms == 10.0
    assert t.decide("b", "h1", 1000).reason == "cache-budget"


def test_a_new_version_replaces_the_users_charge() -> None:
    clock = Clock()
    t = trigger(clock, cache_budget_bytes=100_000)
    assert t.decide("a", "h1", 1000).admitted
    assert t.decide("a", "h2", 1000).admitted  # would not fit next to h1, but replaces it
    assert t.live_bytes == 100_000


def test_footprint_expires_and_forget_releases() -> None:
    clock = Clock()
    t = trigger(clock, cache_budget_bytes=100_000, footprint_ttl_s=60.0)
    assert t.decide("a", "h", 1000).admitted
    assert t.decide("b", "h", 1000).reason == "cache-budget"
    clock.t += 60.0
    assert t.decide("b", "h", 1000).admitted
    t.forget("b")
    assert t.live_bytes == 0


def test_disabled_trigger_admits_nothing() -> None:
    t = trigger()
    t.enabled = False
    assert t.decide("a", "h", 10_000).reason == "disabled"


def test_latency_model_interpolates_and_extrapolates() -> None:
    m = LatencyModel.from_profile([32, 64, 128, 256], [1.0, 3.0, 2.0, 16.0], [0.5, 0.6, 0.7, 0.9],
                                  [0.8, 2.5, 9.0, 30.0], 1032)
    assert m.predict_full_ms(48) == pytest.approx(2.0)
    assert m.predict_full_ms(96) == pytest.approx(3.0)  # the noisy dip at 128 is smoothed to non-decreasing
    assert m.predict_full_ms(512) == pytest.approx(64.0)  # quadratic beyond the longest measured length
    assert m.predict_cached_ms(512) == pytest.approx(1.8)  # linear
    assert m.predict_prefill_ms(16) == pytest.approx(0.4)  # proportional below the shortest
    assert m.kv_bytes(10) == 10_320
    assert LatencyModel.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match="increasing"):
        LatencyModel.from_profile([64, 32], [1, 2], [1, 2], [1, 2], 8)


def test_admit_all_admits_every_signal_without_checks_or_charges() -> None:
    t = trigger(admit_all=True, cache_budget_bytes=0, prefill_budget_ms=0.0)
    for user in range(5):  # short (not at risk) and over both budgets: admitted all the same
        d = t.decide(f"u{user}", "v", 10)
        assert d.admitted and d.reason == "admitted"
    assert t.live_bytes == 0 and t.window_load_ms == 0.0


def _busy_reports(t: SequenceAwareTrigger, clock: Clock, replica: str, busy: float) -> None:
    """Two stats reports 1 s apart whose compute totals (every kind) grew by ``busy`` x 1000 ms."""
    t.report(replica, {"compute_ms_total": {"prefill": 0.0, "rank_full": 0.0}})
    clock.t += 1.0
    t.report(replica, {"compute_ms_total": {"prefill": 100.0 * busy, "rank_full": 900.0 * busy}})


def test_a_miss_on_a_busy_ranker_is_at_risk_where_an_idle_one_is_not() -> None:
    """Full inference at 50 tokens takes 5 ms idle, far under the 50 ms threshold. Under load the rule takes
    the miss's time at the SLO's percentile (P99) as an M/M/1 sojourn time: 5 x ln(100) / (1 - ρ), 28.8 ms on a
    ranker busy 20% of the time (not at risk), 57.6 ms at 60% (at risk). Without reports (or with the rule off)
    the idle time decides."""
    clock = Clock()
    t = trigger(clock)
    p99 = math.log(100.0)
    _busy_reports(t, clock, "r1", 0.6)
    assert t.miss_ms(50, "r1") == pytest.approx(5.0 * p99 / 0.4)
    assert t.decide("a", "h", 50, "r2").reason == "not-at-risk"  # r2 reports nothing
    d = t.decide("b", "h", 50, "r1")
    assert d.admitted and d.predicted_full_ms == pytest.approx(5.0)
    _busy_reports(t, clock, "r3", 0.2)
    assert t.miss_ms(50, "r3") == pytest.approx(5.0 * p99 / 0.8)
    assert t.decide("c", "h", 50, "r3").reason == "not-at-risk"
    _busy_reports(t, clock, "r4", 1.0)  # saturated: 1 - ρ floored at min_idle_fraction 0.1
    assert t.miss_ms(50, "r4") == pytest.approx(5.0 * p99 / 0.1)
    median = trigger(clock, slo_percentile=50.0)  # the percentile is the SLO's: at P50 ln(2) replaces ln(100)
    _busy_reports(median, clock, "r1", 0.6)
    assert median.miss_ms(50, "r1") == pytest.approx(5.0 * math.log(2.0) / 0.4)
    assert median.decide("b", "h", 50, "r1").reason == "not-at-risk"
    off = trigger(clock, load_aware_risk=False)
    _busy_reports(off, clock, "r1", 0.6)
    assert off.decide("b", "h", 50, "r1").reason == "not-at-risk"
    clock.t += 10.0  # reports older than report_ttl_s are ignored: the idle time decides again
    assert t.decide("d", "h", 50, "r1").reason == "not-at-risk"


@pytest.mark.parametrize("bad", [{"slo_percentile": 0.0}, {"slo_percentile": 100.0}, {"min_idle_fraction": 0.0}])
def test_trigger_config_refuses_percentiles_and_floors_out_of_range(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        TriggerConfig(**bad)


def test_a_prefix_stops_counting_against_the_footprint_once_its_rank_is_routed() -> None:
    """The footprint holds prefixes awaiting their rank; after it they are ordinary cache entries. A repeat
    signal for a served version is admitted as live, uncharged."""
    t = trigger(cache_budget_bytes=100_000)  # one 1000-token prefix
    assert t.decide("a", "v1", 1000).admitted
    assert t.decide("b", "v1", 1000).reason == "cache-budget"
    t.consumed("a")
    assert t.live_bytes == 0
    assert t.decide("b", "v1", 1000).reason == "admitted"
    again = t.decide("a", "v1", 1000)
    assert again.reason == "live" and t.live_bytes == 100_000  # a's served prefix is not charged again
    assert t.decide("a", "v2", 1000).reason == "cache-budget"  # a new version of a's history is


def test_load_budget_charges_only_the_share_of_admissions_whose_rank_did_not_follow() -> None:
    # 4 admissions fill a 40 ms budget (10 ms each); the window of outcomes is 4 with 4 needed to count
    clock = Clock()
    t = trigger(clock, prefill_budget_ms=40.0, window_s=1.0, follow_window=4, follow_min_samples=4)
    assert [t.decide(f"u{i}", "h", 1000).reason for i in range(5)] == ["admitted"] * 4 + ["load-budget"]
    assert t.speculative_share == 1.0  # none of the four ranks came yet
    for i in range(4):
        t.consumed(f"u{i}")  # every rank followed its signal: prefilling replaced their full inference
    assert t.speculative_share == 0.0
    # the same 40 ms of prefills are still in the window, but none of it was speculative: admitted
    assert t.decide("u4", "h", 1000).reason == "admitted"
    assert t.speculative_share == pytest.approx(0.25)  # u4's outcome is open; u0's has left the window


def test_unfollowed_signals_bring_the_load_budget_back() -> None:
    clock = Clock()
    t = trigger(clock, prefill_budget_ms=20.0, window_s=1.0, follow_window=4, follow_min_samples=2)
    assert t.decide("a", "h", 1000).admitted and t.decide("b", "h", 1000).admitted
    t.consumed("a")
    t.consumed("b")
    assert t.speculative_share == 0.0
    # ranks that go elsewhere or never come: the admissions' outcomes stay unfollowed
    for user in ("c", "d", "e"):
        clock.t += 1.0  # each in a fresh window
        assert t.decide(user, "h", 1000).admitted
        t.forget(user)
    assert t.speculative_share == pytest.approx(0.75)  # the window of 4: b followed, c, d, e did not
    clock.t += 1.0
    assert t.decide("f", "h", 1000).admitted  # 0.75 x 10 ms <= 20
    assert t.speculative_share == 1.0  # the window is c, d, e (unfollowed) and f (open)
    assert t.decide("g", "h", 1000).admitted  # 1.0 x 20 ms <= 20, inclusive
    assert t.decide("h", "h", 1000).reason == "load-budget"  # 1.0 x 30 ms > 20


def test_a_rank_routed_after_its_prefix_expired_does_not_count_as_followed() -> None:
    clock = Clock()
    t = trigger(clock, footprint_ttl_s=5.0, follow_window=8, follow_min_samples=1)
    assert t.decide("a", "h", 1000).admitted
    clock.t += 6.0  # the admission's charge expired before the rank came
    t.consumed("a")
    assert t.speculative_share == 1.0


def test_follow_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="follow_min_samples"):
        TriggerConfig(follow_window=4, follow_min_samples=5)


def test_speculative_share_counts_exactly_the_last_window_of_admissions() -> None:
    import random

    rng = random.Random(7)
    t = trigger(follow_window=8, follow_min_samples=1)
    followed: list[bool] = []
    for i in range(200):
        user = f"u{i}"
        assert t.decide(user, "h", 1000).admitted
        followed.append(False)
        if rng.random() < 0.6:  # some ranks follow (late ones too: after later admissions)
            back = rng.randrange(min(3, len(followed)))
            j = len(followed) - 1 - back
            t.consumed(f"u{j}")
            followed[j] = True
        window = followed[-8:]
        assert t.speculative_share == pytest.approx(1.0 - sum(window) / len(window))


def test_a_ranker_slower_in_service_than_its_profile_makes_a_miss_at_risk() -> None:
    """Full inference at 300 tokens is profiled at 30 ms, under the 50 ms threshold; a ranker reporting its steps
    cost 2x that in service makes it 60 ms (at risk). No factor, or the rule off: the profile decides."""
    clock = Clock()
    t = trigger(clock, load_aware_risk=False)
    assert t.decide("a", "h", 300, "r1").reason == "not-at-risk"
    t.report("r1", {"service_cost_factor": 2.0})
    assert t.miss_ms(300, "r1") == pytest.approx(60.0)
    assert t.decide("b", "h", 300, "r1").admitted
    t.report("r2", {"service_cost_factor": None})
    assert t.decide("c", "h", 300, "r2").reason == "not-at-risk"
    off = trigger(clock, load_aware_risk=False, in_service_risk=False)
    off.report("r1", {"service_cost_factor": 2.0})
    assert off.decide("d", "h", 300, "r1").reason == "not-at-risk"
    loaded = trigger(clock)  # with the load-aware rule the factor scales the mean the M/M/1 tail is taken of
    _busy_reports(loaded, clock, "r1", 0.6)
    loaded.report("r1", {"service_cost_factor": 1.5, "compute_ms_total": {"prefill": 60.0, "rank_full": 540.0}})
    assert loaded.miss_ms(50, "r1") == pytest.approx(5.0 * 1.5 * math.log(100.0) / 0.4)


def test_the_latest_model_is_fitted_once_per_profile_object() -> None:
    from types import SimpleNamespace

    from grstack.runtime.serve.trigger import latest_model

    def profile(full: float) -> SimpleNamespace:
        return SimpleNamespace(lengths=[100], full_ms=[full], cached_ms=[1.0], prefill_ms=[full], kv_bytes_per_token=8)

    current: list[SimpleNamespace | None] = [None]
    model = latest_model(lambda: current[0])
    assert model() is None  # no profile yet
    current[0] = profile(10.0)
    first = model()
    assert first is not None and first.predict_full_ms(100) == 10.0 and model() is first  # not fitted again
    current[0] = profile(20.0)  # replaced: fitted to the new curves
    assert model().predict_full_ms(100) == 20.0

"""The trigger's per-ranker budgets from the rankers' load reports (no network: reports given directly)."""

from __future__ import annotations

import pytest

from grstack.runtime.serve.trigger import LatencyModel, RankerLoad, SequenceAwareTrigger, TriggerConfig

pytestmark = pytest.mark.unit

# full(L) = L / 10 ms, cached 1 ms, prefill 10 ms at any length, 100 B/token (as in test_trigger.py)
MODEL = LatencyModel(lengths=(100, 2000), full_ms=(10.0, 200.0), cached_ms=(1.0, 1.0), prefill_ms=(10.0, 10.0),
                     kv_bytes_per_token=100)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def trigger(clock: Clock, **cfg: object) -> SequenceAwareTrigger:
    base = {"slo_ms": 100.0, "cache_budget_bytes": 10**9, "prefill_budget_ms": 10**6, "window_s": 10.0,
            "ranker_prefill_budget_ms": 100.0, "report_interval_s": 10.0}  # the share between reports: all of it
    return SequenceAwareTrigger(MODEL, TriggerConfig(**{**base, **cfg}), clock=clock)


def stats(prefill_ms: float, backlog_tokens: int = 0, prefills: int = 0, **extra: object) -> dict:
    return {"compute_ms_total": {"prefill": prefill_ms, "rank_cached": 0.0, "rank_full": 0.0},
            "prefill_backlog_tokens": backlog_tokens, "queue_depth": {"hits": 0, "misses": 0, "prefills": prefills},
            "queued": prefills, **extra}


def test_ranker_load_rate_backlog_and_restart() -> None:
    load = RankerLoad(window_s=10.0)
    load.observe(stats(1000.0), 0.0)
    assert load.prefill_rate_ms_per_s == 0.0  # one sample: no rate yet
    load.observe(stats(1300.0, backlog_tokens=2000, prefills=2), 1.0)
    assert load.prefill_rate_ms_per_s == pytest.approx(300.0)
    assert load.backlog_ms(MODEL) == pytest.approx(20.0)  # two queued prefills of 1000 tokens, 10 ms each
    assert load.load_ms(MODEL) == pytest.approx(300.0 * 10 + 20.0)
    for t in range(2, 30):  # samples older than the window leave: the rate is the recent one
        load.observe(stats(1300.0 + (t - 1) * 300.0 if t < 15 else 1300.0 + 13 * 300.0), float(t))
    assert load.prefill_rate_ms_per_s == pytest.approx(0.0)
    load.observe(stats(5.0), 30.0)  # the counter went back: a restarted ranker, history starts afresh
    assert load.prefill_rate_ms_per_s == 0.0
    old = RankerLoad(window_s=10.0)
    old.observe({"queued": 3, "device_bytes": 7}, 0.0)  # a ranker that reports no compute
    assert old.load_ms(MODEL) is None and old.queued == 3 and old.capacity_bytes == 0


def test_per_ranker_load_budget_counts_the_measured_rate_backlog_and_own_admissions() -> None:
    clock = Clock()
    t = trigger(clock)
    t.report("a", stats(0.0))
    clock.t += 1.0
    t.report("a", stats(4.0, backlog_tokens=1000, prefills=1))  # 4 ms/s x 10 s + 10 ms queued = 50 ms
    admitted = [t.decide(f"u{i}", "v", 1000, "a").reason for i in range(7)]
    assert admitted == ["admitted"] * 5 + ["load-budget"] * 2  # 50 + 5 x 10 = 100, inclusive
    assert t.pending_ms("a") == 50.0
    clock.t += 1.0
    t.report("a", stats(4.0 + 4.0, backlog_tokens=6000, prefills=6))  # the five arrived in its queue
    assert t.pending_ms("a") == 0.0  # no longer "since the report": counted in the backlog instead
    assert t.decide("u9", "v", 1000, "a").reason == "load-budget"
    assert t.decide("u9", "v", 1000, "b").reason == "admitted"  # no report from b: the router-wide budget


def test_two_routers_sharing_a_ranker_stay_within_its_budget_together() -> None:
    clock = Clock()
    routers = [trigger(clock), trigger(clock)]
    queued = 0  # what the one ranker has in its prefill queue
    admitted = 0
    for i in range(20):
        for r in routers:  # both poll the ranker before each signal
            r.report("a", stats(0.0, backlog_tokens=1000 * queued, prefills=queued))
        clock.t += 0.01
        if routers[i % 2].decide(f"u{i}", "v", 1000, "a").admitted:
            queued += 1
            admitted += 1
    assert admitted == 10  # 100 ms / 10 ms: the ranker's budget once, not once per router


def test_between_reports_one_router_admits_only_its_share_of_a_rankers_budget() -> None:
    clock = Clock()
    t = trigger(clock, report_interval_s=2.5)  # 100 ms x 2.5 s / 10 s: 25 ms between two reports
    t.report("a", stats(0.0))
    assert [t.decide(f"u{i}", "v", 1000, "a").reason for i in range(4)] == ["admitted"] * 2 + ["load-budget"] * 2
    clock.t += 0.5
    t.report("a", stats(0.0, backlog_tokens=2000, prefills=2))
    assert t.decide("u3", "v", 1000, "a").admitted
    big = trigger(clock, report_interval_s=0.1)  # a share smaller than one prefill still admits one
    big.report("a", stats(0.0))
    assert [big.decide(f"u{i}", "v", 1000, "a").reason for i in range(2)] == ["admitted", "load-budget"]


def test_per_ranker_footprint_from_reported_capacity_or_configured_bytes() -> None:
    clock = Clock()
    t = trigger(clock, ranker_cache_fraction=0.5, ranker_cache_budget_bytes=100_000)
    t.report("a", stats(0.0, device_capacity_bytes=300_000, dram_capacity_bytes=100_000))  # budget 200 kB
    t.report("b", stats(0.0))  # no capacity reported: the configured 100 kB
    assert [t.decide(f"a{i}", "v", 1000, "a").reason for i in range(3)] == ["admitted"] * 2 + ["cache-budget"]
    assert [t.decide(f"b{i}", "v", 1000, "b").reason for i in range(2)] == ["admitted", "cache-budget"]
    assert t.replica_bytes("a") == 200_000 and t.replica_bytes("b") == 100_000
    assert t.decide("a0", "v2", 1000, "a").admitted  # a new version replaces the user's entry on that ranker
    t.forget("b0")
    assert t.replica_bytes("b") == 0 and t.decide("b1", "v", 1000, "b").admitted


def test_a_recomputed_live_prefix_is_charged_to_the_ranker_that_computed_it() -> None:
    clock = Clock()
    t = trigger(clock)
    t.report("a", stats(0.0))
    t.report("b", stats(0.0))
    assert t.decide("u", "v", 1000, "a").reason == "admitted"
    assert t.decide("u", "v", 1000, "a").reason == "live"
    assert t.pending_ms("a") == 10.0  # live: not charged again
    t.charge("u", "v", 1000, "b")  # the signal went to b, which computed it
    assert t.pending_ms("b") == 10.0 and t.replica_bytes("b") == 100_000 and t.replica_bytes("a") == 0
    assert t.live_bytes == 100_000


def test_a_stale_report_falls_back_to_the_router_wide_budget() -> None:
    clock = Clock()
    t = trigger(clock, report_ttl_s=5.0, prefill_budget_ms=10.0)
    t.report("a", stats(0.0, backlog_tokens=100_000, prefills=100))  # 1 s of backlog: over its budget
    assert t.decide("u1", "v", 1000, "a").reason == "load-budget"
    assert t.ranker_load_ms("a") == pytest.approx(1000.0)
    clock.t += 5.1
    assert t.ranker_load_ms("a") is None
    assert t.decide("u1", "v", 1000, "a").reason == "admitted"  # router-wide: 10 ms fits
    assert t.decide("u2", "v", 1000, "a").reason == "load-budget"
    t.report("a", None)  # the ranker stopped answering
    assert "a" not in t.loads


def test_admit_all_ignores_the_rankers_budgets() -> None:
    clock = Clock()
    t = trigger(clock, admit_all=True)
    t.report("a", stats(0.0, backlog_tokens=100_000, prefills=100, device_capacity_bytes=1))
    assert all(t.decide(f"u{i}", "v", 10, "a").admitted for i in range(3))
    assert t.pending_ms("a") == 0.0


def test_cli_flags_reach_the_router_and_trigger() -> None:
    from grstack.runtime.cli_args import ArgParser
    from grstack.runtime.errors import UserError
    from grstack.runtime.serve import cli

    parser = ArgParser()  # a bad value is the parser's UsageError, a UserError naming the flag
    cli.register(parser)
    base = ["router", "--rankers", "http://127.0.0.1:1"]
    cfg = cli.router_config(parser.parse_args(base))
    assert (cfg.load_poll_interval_s, cfg.overload_min_load, cfg.trigger.ranker_cache_fraction) == (1.0, 4, 0.8)
    cfg = cli.router_config(parser.parse_args([*base, "--load-poll-interval-s", "0", "--overload-min-load", "8",
                                               "--ranker-cache-fraction", "0.5"]))
    assert (cfg.load_poll_interval_s, cfg.overload_min_load, cfg.trigger.ranker_cache_fraction) == (0.0, 8, 0.5)
    for bad in (["--ranker-cache-fraction", "1.5"], ["--overload-min-load", "0"], ["--load-poll-interval-s", "-1"]):
        with pytest.raises(UserError, match=bad[0]):
            cli.router_config(parser.parse_args([*base, *bad]))
    with pytest.raises(UserError, match="--max-step-tokens"):
        cli.ranker_config(parser.parse_args(["ranker", "--checkpoint", "m.pt", "--max-step-tokens", "0"]), 64)


def busy_stats(compute_ms: float) -> dict:
    return {"compute_ms_total": {"prefill": 0.0, "rank_cached": compute_ms, "rank_full": 0.0}}


def test_busy_fraction_sees_a_burst_from_the_first_report_after_it() -> None:
    load = RankerLoad(window_s=10.0)
    load.observe(busy_stats(0.0), 0.0)
    assert load.busy_fraction is None  # one report: nothing to compare yet
    for t in range(1, 10):  # nine idle seconds
        load.observe(busy_stats(0.0), float(t))
    assert load.busy_fraction == 0.0
    load.observe(busy_stats(800.0), 10.0)  # then a second 80% busy: the window's average is 8%
    assert load.busy_fraction == pytest.approx(0.8)
    load.observe(busy_stats(800.0), 11.0)  # the burst is over; the window still holds it
    assert load.busy_fraction == pytest.approx(800.0 / 10.0 / 1e3)
    load.observe(busy_stats(5000.0), 12.0)  # more than the interval itself (a late report): capped at 1
    assert load.busy_fraction == 1.0

"""``bench serve``'s rules: a limit is the largest value for which it and every smaller value pass; a sweep
stops at its first failure (probing down by halves when the lowest fails); answers are sorted into served,
shed and other errors; repeats combine by the median P99; ranker counters become per-point deltas."""

import asyncio
import math

import pytest

from grstack.runtime.bench.serve import (
    combine,
    repeat_order,
    rotated,
    run_sweeps,
    state_deltas,
    summarize,
    sweep_limit,
)
from grstack.runtime.serve.loadgen import Request, Result

pytestmark = pytest.mark.unit


def pts(*pairs):
    return [{"qps": v, "meets_slo": ok} for v, ok in pairs]


def test_limit_needs_every_smaller_value_to_pass():
    assert sweep_limit(pts((10, True), (20, True), (40, False)), "qps") == 20
    assert sweep_limit(pts((10, True), (20, False), (40, True)), "qps") == 10  # a later pass cannot count
    assert sweep_limit(pts((40, True), (10, False), (20, True)), "qps") is None  # order of the list is irrelevant
    assert sweep_limit(pts((10, True), (20, True)), "qps") == 20
    assert sweep_limit([], "qps") is None


def sweeps(values, passing, floor=None, modes=("m",)):
    """Runs the interleaved sweeps; ``passing(mode, value)``. Returns the (mode, value) measured, in order."""
    seen = []

    async def step(order, v):
        out = {}
        for mode in order:
            seen.append((mode, v))
            out[mode] = {"qps": v, "meets_slo": passing(mode, v)}
        return out

    points = asyncio.run(run_sweeps(list(modes), values, step, floor))
    return seen, points


def sweep(values, passing, floor=None):
    seen, points = sweeps(values, lambda _, v: passing(v), floor)
    return [v for _, v in seen], points["m"]


def test_sweep_stops_at_the_first_failure():
    seen, points = sweep([40, 10, 20, 80], lambda v: v <= 20)
    assert seen == [10, 20, 40]  # ascending, 80 never measured
    assert sweep_limit(points, "qps") == 20


def test_sweep_probes_down_by_halves_when_the_lowest_fails():
    seen, points = sweep([10, 20], lambda v: v <= 3, floor=2.5)
    assert seen == [10, 5, 2.5]
    assert [p["qps"] for p in points] == [2.5, 5, 10]
    assert sweep_limit(points, "qps") == 2.5
    seen, points = sweep([10, 20], lambda v: False, floor=2.5)
    assert seen == [10, 5, 2.5] and sweep_limit(points, "qps") is None
    seen, _ = sweep([10, 20], lambda v: v <= 6, floor=2.5)
    assert seen == [10, 5]  # stops at the first passing probe
    seen, _ = sweep([10, 20], lambda v: False)
    assert seen == [10]  # no floor (the length sweep): no probing


def test_rotated_starts_each_step_with_the_next_mode():
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], 5) == ["c", "a", "b"]
    assert rotated([], 3) == []


def test_each_repeat_measures_every_mode_in_a_rotated_order():
    assert repeat_order(["a", "b", "c"], 1) == [("a", 0), ("b", 0), ("c", 0)]
    assert repeat_order(["a", "b", "c"], 3) == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                                                ("c", 2), ("a", 2), ("b", 2)]
    assert repeat_order(["a"], 2) == [("a", 0), ("a", 1)]


def test_modes_are_interleaved_each_stopping_at_its_own_first_failure():
    limits = {"base": 20, "relay": 80, "abl": 40}
    seen, points = sweeps([10, 20, 40, 80, 160], lambda m, v: v <= limits[m], modes=("base", "relay", "abl"))
    # every mode still sweeping is measured at each value before any moves on; the order rotates by one
    assert seen == [("base", 10), ("relay", 10), ("abl", 10),
                    ("relay", 20), ("abl", 20), ("base", 20),
                    ("abl", 40), ("base", 40), ("relay", 40),  # base fails 40 and drops out
                    ("abl", 80), ("relay", 80),  # abl fails 80
                    ("relay", 160)]
    assert {m: sweep_limit(p, "qps") for m, p in points.items()} == limits
    assert [p["qps"] for p in points["base"]] == [10, 20, 40]


def test_interleaved_probes_run_only_for_the_modes_failing_the_lowest_value():
    seen, points = sweeps([10, 20], lambda m, v: m == "ok" or v <= 3, floor=2.5, modes=("ok", "low"))
    # the probes below the lowest value run after the sweep, for the failing mode only
    assert seen == [("ok", 10), ("low", 10), ("ok", 20), ("low", 5), ("low", 2.5)]
    assert sweep_limit(points["low"], "qps") == 2.5 and sweep_limit(points["ok"], "qps") == 20


def res(status, ms, measure=True, headers=None, payload=None, error=""):
    return Result(Request(0.0, "/v1/rank", b"", "u", measure), status, ms, payload, error, headers or {})


def test_answers_are_sorted_into_served_shed_and_other_errors():
    shed = {"X-Grstack-Shed": "deadline"}
    assert res(200, 1.0).kind == "ok"
    assert res(504, 1.0, headers=shed).kind == "shed_504"
    assert res(503, 1.0, headers={"X-Grstack-Shed": "queue-full"}).kind == "shed_503"
    assert res(503, 1.0).kind == "http_503"  # a 503 without the shed header is a failure, not a shed
    assert res(0, math.inf, error="TimeoutError: ").kind == "timeout"
    assert res(0, math.inf, error="ClientConnectorError: refused").kind == "connection"


def test_summary_counts_measured_ranks_only_and_fails_on_any_error():
    ok = [Result(Request(i * 0.1, "/v1/rank", b"", "u", True), 200, 10.0 + i, {"cache": "device" if i % 2 else "miss"})
          for i in range(99)]
    warm = [res(504, math.inf, measure=False, headers={"X-Grstack-Shed": "deadline"})]
    s = summarize(ok + warm, slo_ms=200.0)
    assert s["n"] == 99 and s["meets_slo"] and s["errors_by_kind"] == {}
    assert s["hit_rate"] == pytest.approx(49 / 99) and s["cache"] == {"device": 49, "miss": 50}
    assert s["served_qps"] == pytest.approx(99 / 9.8)
    shed = Result(Request(9.9, "/v1/rank", b"", "u", True), 504, 150.0, None, "", {"X-Grstack-Shed": "deadline"})
    s = summarize([*ok, shed], slo_ms=200.0)
    assert s["errors_by_kind"] == {"shed_504": 1} and not s["meets_slo"] and s["p99_ms_shed"] == 150.0


def test_a_point_the_generator_gave_up_on_fails_with_the_sent_ranks_p99_kept():
    sent = [Result(Request(i * 0.1, "/v1/rank", b"", "u", True), 200, 150.0 if i < 10 else 10.0, {})
            for i in range(40)]
    s = summarize(sent, slo_ms=100.0, planned=1000)
    assert s["stopped_early"] and s["planned"] == 1000 and s["n"] == 40
    assert s["p99_ms"] == math.inf and not s["meets_slo"] and s["p99_ms_sent"] == 150.0
    whole = summarize(sent, slo_ms=100.0, planned=40)
    assert not whole["stopped_early"] and whole["p99_ms"] == 150.0 and "p99_ms_sent" not in whole


def test_repeats_combine_by_median_p99_with_spread():
    base = {"n": 10, "planned": 10, "stopped_early": False, "p50_ms": 5.0, "errors_by_kind": {},
            "cache": {"device": 5, "miss": 5},
            "prefill_tokens_computed": 10, "prefill_tokens_without_incremental": 20, "joined_inflight_ranks": 1,
            "prefill_cpu_share": 0.2, "device_bytes": 1, "dram_bytes": 2}
    runs = [{**base, "p99_ms": 50.0}, {**base, "p99_ms": math.inf, "errors_by_kind": {"timeout": 1}},
            {**base, "p99_ms": 90.0}]
    c = combine(runs, slo_ms=100.0)
    assert c["p99_ms"] == 90.0 and c["p99_ms_min"] == 50.0 and c["p99_ms_max"] == math.inf
    assert c["meets_slo"] and c["errors_by_kind"] == {"timeout": 1} and c["n"] == 30
    assert c["prefill_tokens_computed"] == 30 and c["hit_rate"] == pytest.approx(0.5)
    assert not combine(runs[1:], slo_ms=80.0)["meets_slo"]


def test_ranker_counters_become_deltas_and_absent_fields_none():
    before = [{"compute_ms_total": {"prefill": 10.0, "rank_cached": 5.0, "rank_full": 5.0},
               "prefill_tokens_computed": 100, "prefill_tokens_without_incremental": 150, "joined": 1.0,
               "device_bytes": 7, "dram_bytes": 0}] * 2
    after = [{"compute_ms_total": {"prefill": 40.0, "rank_cached": 15.0, "rank_full": 25.0},
              "prefill_tokens_computed": 300, "prefill_tokens_without_incremental": 550, "joined": 3.0,
              "device_bytes": 9, "dram_bytes": 4}] * 2
    d = state_deltas(before, after, visits=12)
    assert d["prefill_cpu_share"] == pytest.approx(30 / 60)
    assert d["compute_ms_per_visit"] == pytest.approx(120 / 12)  # both rankers' compute over the visits sent
    assert d["prefill_tokens_computed"] == 400 and d["prefill_tokens_without_incremental"] == 800
    assert d["joined_inflight_ranks"] == 4 and d["device_bytes"] == 18 and d["dram_bytes"] == 8
    old = [{"device_bytes": 1, "dram_bytes": 0, "joined": 0.0}]
    d = state_deltas(old, old, visits=5)
    assert d["prefill_cpu_share"] is None and d["prefill_tokens_computed"] is None
    assert d["compute_ms_per_visit"] is None


def test_score_samples_follow_each_rank_request_to_its_visit_whatever_the_answer_order():
    import itertools
    import json

    from grstack.runtime.bench.serve import encode, keep_for_score_check
    from grstack.runtime.bench.serve_trace import TraceConfig, build_trace, population

    cfg = TraceConfig(users=200, length=8, warmup=5, measured=40, seed=1)
    trace = build_trace(population(cfg.users, cfg.seed), cfg)
    reqs, visit_of = encode(trace, "t")
    ranks = [r for r in reqs if r.path == "/v1/rank"]
    assert sum(r.path == "/v1/prefill" for r in reqs) == len(trace.visits)  # every visit signals
    assert len(ranks) == sum(v.ranked for v in trace.visits) < len(trace.visits)  # not every signal is followed
    assert sum(r.measure for r in ranks) == cfg.measured
    pairs = [(p, r) for p, r in itertools.pairwise(reqs) if r.path == "/v1/rank"]
    assert len(pairs) == len(ranks) and all(p.path == "/v1/prefill" for p, _ in pairs)
    assert all(json.loads(p.body)["long_term"] == json.loads(r.body)["long_term"]
               for p, r in pairs)  # a rank follows its own visit's signal, with the same prefix
    answers = [Result(r, 200, 1.0, {"cache": "device", "scores": json.loads(r.body)["candidates"]})
               for r in reversed(ranks)]  # answers in another order than the visits
    kept = []
    keep_for_score_check(kept, "relay", trace, visit_of, answers)
    assert kept and all(k["scores"] == k["candidates"].tolist() for k in kept)
    assert kept[0]["grew"] or not any(v.grew for v in trace.visits)  # grown histories are checked first


def test_capacity_is_the_rankers_compute_bound_at_the_qps_sweeps_length():
    from grstack.runtime.bench.serve import capacity

    pts = [{"sweep": "length", "compute_ms_per_visit": 5.0},
           {"sweep": "qps", "compute_ms_per_visit": 40.0},
           {"sweep": "qps", "compute_ms_per_visit": 60.0},
           {"sweep": "qps", "compute_ms_per_visit": 50.0}]
    cap = capacity(pts, rankers=2)
    assert cap["compute_ms_per_visit"] == 50.0  # the median of the QPS sweep only
    assert cap["ceiling_qps"] == pytest.approx(40.0)  # 2 rankers x 1000 ms / 50 ms per visit
    assert capacity(pts[:1], rankers=2) == {"compute_ms_per_visit": None, "ceiling_qps": None}
    assert capacity(pts[1:3], rankers=1)["compute_ms_per_visit"] == 50.0  # even count: mean of the middle two


def test_trigger_decisions_are_per_point_deltas_by_reason():
    from grstack.runtime.bench.serve import _TRIGGER_LINE, trigger_deltas

    text = ('# TYPE grstack_router_trigger_total counter\n'
            'grstack_router_trigger_total{reason="admitted"} 12.0\n'
            'grstack_router_trigger_total{reason="load-budget"} 3.0\n'
            'grstack_router_trigger_created{reason="admitted"} 1.7e9\n')
    after = {k: float(v) for k, v in _TRIGGER_LINE.findall(text)}
    assert after == {"admitted": 12.0, "load-budget": 3.0}
    assert trigger_deltas({"admitted": 10.0, "load-budget": 3.0}, after) == {"admitted": 2}
    assert trigger_deltas({}, after) == {"admitted": 12, "load-budget": 3}


def test_only_the_baseline_rankers_drop_their_misses_prefixes():
    import argparse

    from grstack.runtime.bench.serve import MODES, ranker_args
    from grstack.runtime.serve.cli import ranker_config, register

    parser = argparse.ArgumentParser()
    register(parser)
    for mode in MODES:
        args = parser.parse_args(["ranker", "--checkpoint", "m.pt", *ranker_args(mode)])
        assert ranker_config(args, max_len=1024).cache_misses is (mode != "baseline")  # baseline: full inference


def test_gc_counts_read_a_rankers_pause_histogram():
    from prometheus_client import CollectorRegistry, generate_latest

    from grstack.runtime.bench.serve import gc_counts
    from grstack.runtime.serve.gc_pauses import GcPauseMetric

    registry = CollectorRegistry()
    metric = GcPauseMetric(registry, "grstack_ranker")
    try:
        metric.histogram.labels("0").observe(0.001)
        metric.histogram.labels("2").observe(0.03)
        metric.histogram.labels("2").observe(0.2)
        text = generate_latest(registry)
    finally:
        metric.close()
    got = gc_counts(text.decode())
    assert got["count"] >= 3  # the process's own collections may add to the three observed here
    assert got["over_25ms"] >= 2 and got["over_50ms"] >= 1 and got["over_100ms"] >= 1
    assert got["over_25ms"] - got["over_50ms"] >= 1  # 30 ms is over 25 and not over 50


def test_gc_summary_and_repeats():
    from grstack.runtime.bench.serve import gc_over, gc_summary

    zero = {"count": 0.0, "over_25ms": 0.0, "over_50ms": 0.0, "over_100ms": 0.0}
    after = {"count": 9.0, "over_25ms": 2.0, "over_50ms": 1.0, "over_100ms": 0.0}
    one = gc_summary(zero, after, [0.001, 0.06, 0.2])
    assert one["rankers"] == {"count": 9, "over_25ms": 2, "over_50ms": 1, "over_100ms": 0}
    assert one["harness"] == {"count": 3, "over_25ms": 2, "over_50ms": 2, "over_100ms": 1, "max_ms": 200.0}
    two = gc_over([{"gc_pauses": one}, {"gc_pauses": gc_summary(zero, zero, [])}])
    assert two["rankers"]["count"] == 9 and two["harness"]["over_100ms"] == 1 and two["harness"]["max_ms"] == 200.0
    assert gc_over([{}]) is None


def test_recorded_gc_pauses_sees_this_process_collect_and_then_stops():
    import gc

    from grstack.runtime.serve import recorded_gc_pauses

    before = len(gc.callbacks)
    with recorded_gc_pauses() as pauses:
        gc.collect()
    assert len(pauses) >= 1 and all(p >= 0 for p in pauses)
    assert len(gc.callbacks) == before
    seen = len(pauses)
    gc.collect()
    assert len(pauses) == seen  # nothing recorded after the block

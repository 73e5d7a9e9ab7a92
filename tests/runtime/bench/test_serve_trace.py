"""``bench serve``'s visit trace: seeded, warm-up then measured visits, histories that grow only between
sessions, signals a jittered cascade gap before their ranks, the point's mean rate, and Zipf-like skew
(the new protocol's own properties: test_serve_trace_protocol.py)."""

from dataclasses import replace

import numpy as np
import pytest

from grstack.runtime.bench.serve_trace import (
    TraceConfig,
    base_lengths,
    build_trace,
    population,
    signals_needed,
    zipf_weights,
)

pytestmark = pytest.mark.unit

CFG = TraceConfig(users=300, length=32, qps=40.0, warmup=30, measured=150, gap_ms=50.0, jitter=0.2, seed=3)


@pytest.fixture(scope="module")
def pop():
    return population(CFG.users, CFG.seed)


@pytest.fixture(scope="module")
def trace(pop):
    return build_trace(pop, CFG)


def test_same_seed_same_trace_other_seed_other_trace(pop, trace):
    again = build_trace(pop, CFG)
    assert [(v.user, v.t, v.wall_s, v.rank_s) for v in again.visits] == \
        [(v.user, v.t, v.wall_s, v.rank_s) for v in trace.visits]
    assert all(np.array_equal(a.long_items, b.long_items) and np.array_equal(a.candidates, b.candidates)
               for a, b in zip(again.visits, trace.visits, strict=True))
    other = build_trace(population(CFG.users, CFG.seed + 1), TraceConfig(**{**CFG.__dict__, "seed": CFG.seed + 1}))
    assert [v.t for v in other.visits] != [v.t for v in trace.visits]


def test_warmup_then_measured_visits_in_send_order(trace):
    ranked = [k for k, v in enumerate(trace.visits) if v.ranked and k >= CFG.warmup]
    assert len(ranked) == CFG.measured and ranked[-1] == len(trace.visits) - 1  # ends at the last measured rank
    walls = [v.wall_s for v in trace.visits]
    assert walls == sorted(walls) and walls[0] == 0.0
    by_user: dict[int, list[int]] = {}
    for v in trace.visits:
        by_user.setdefault(v.user, []).append(v.t)
    assert all(ts == sorted(ts) for ts in by_user.values())  # each user's visits keep their stream order


def test_long_term_fixed_within_a_session_and_grows_between_sessions(pop):
    # sessions a few seconds apart (a short TTL), so a point holds several of a user's sessions
    cfg = replace(CFG, dram_ttl_s=0.5)
    trace = build_trace(pop, cfg)
    base = base_lengths(pop, cfg)
    by_session, last_by_user = {}, {}
    grew = 0
    for v in trace.visits:
        key = (v.user, v.session)
        if key in by_session:
            assert np.array_equal(by_session[key], v.long_items)  # same prefix inside a session
            assert v.grew is False
        else:
            by_session[key] = v.long_items
        prev = last_by_user.get(v.user)
        if prev is not None and prev[0] != v.session:
            assert len(v.long_items) >= len(prev[1])  # a later session's prefix extends the earlier one
            assert np.array_equal(v.long_items[:len(prev[1])], prev[1])
            grew += len(v.long_items) > len(prev[1])
        last_by_user[v.user] = (v.session, v.long_items)
        assert len(v.long_items) >= base[v.user]  # the user's base, then the window's events
        assert v.long_ts[-1] < v.short_ts[0] or len(v.long_items) == base[v.user]
        assert 1 <= len(v.short_items) <= CFG.max_short and len(v.candidates) == CFG.candidates
    assert grew > 0, "no history grew: the trace does not exercise incremental prefixes"
    assert trace.shape["prefix_grew_fraction"] > 0


def test_signal_precedes_rank_by_the_jittered_gap(trace):
    gaps = np.array([v.rank_s - v.wall_s for v in trace.visits]) * 1e3
    assert gaps.min() >= CFG.gap_ms * (1 - CFG.jitter) - 1e-9
    assert gaps.max() <= CFG.gap_ms * (1 + CFG.jitter) + 1e-9
    assert gaps.std() > 0  # jittered, not constant


@pytest.mark.parametrize("qps", [10.0, 80.0])
def test_mean_rate_is_the_points_qps_and_a_user_never_visits_faster_than_the_gap(pop, qps):
    t = build_trace(pop, TraceConfig(**{**CFG.__dict__, "qps": qps}))
    n = len(t.visits)
    assert 0.7 * qps < n / t.visits[-1].wall_s < 1.3 * qps  # Poisson arrivals at the point's QPS
    last: dict[int, float] = {}
    counts: dict[int, int] = {}
    for v in t.visits:
        assert v.wall_s >= last.get(v.user, -1e9) + CFG.min_user_gap_s - 1e-9
        last[v.user] = v.wall_s
        counts[v.user] = counts.get(v.user, 0) + 1
    # a higher QPS comes from more users, each capped at what fits the point at one visit per gap
    assert max(counts.values()) <= int(0.5 * signals_needed(CFG) / qps / CFG.min_user_gap_s) + 1
    assert t.shape["user_gap_wall_s_min"] >= CFG.min_user_gap_s - 1e-9


def test_without_the_gap_a_heavy_users_burst_arrives_back_to_back(pop):
    t = build_trace(pop, TraceConfig(**{**CFG.__dict__, "min_user_gap_s": 0.0}))
    assert t.shape["user_gap_wall_s_p50"] < 0.5 * CFG.min_user_gap_s  # why the gap exists


def test_visits_are_skewed_towards_heavy_users(pop):
    # at a low rate the per-user cap (what fits the point at one visit per gap) leaves the Zipf skew alone
    trace = build_trace(pop, TraceConfig(**{**CFG.__dict__, "qps": 2.0}))
    users = np.array([v.user for v in trace.visits])
    counts = np.sort(np.bincount(users, minlength=CFG.users))[::-1]
    top = counts[: int(np.ceil(0.01 * CFG.users))].sum() / len(users)
    assert top > 0.05  # uniform visits would give the top 1% of users about 1%
    assert trace.shape["top1pct_population_visit_share"] == pytest.approx(top)
    w = zipf_weights(np.array([1.0, 5.0, 3.0]), 1.1)
    assert w.argmax() == 1 and w.sum() == pytest.approx(1.0) and w[2] > w[0]


def test_shape_reports_what_the_json_promises(trace):
    for key in ("users", "visits_per_user_p50", "visits_per_user_p99", "top1pct_population_visit_share",
                "sessions_per_user_mean", "mean_long_term_len", "prefix_grew_fraction"):
        assert key in trace.shape
    assert trace.shape["visits"] == len(trace.visits) and trace.shape["measured"] == CFG.measured

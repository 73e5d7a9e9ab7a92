"""The trace's protocol (docs/bench-serve.md, The trace): KuaiRand-like heterogeneous history lengths, a
follow-through below 1, sessions never closer than the DRAM TTL, the cache pressure the population is sized
for, and the share of visits reuse alone could serve."""

from dataclasses import replace

import numpy as np
import pytest

from grstack.runtime.bench.serve_trace import (
    TraceConfig,
    base_lengths,
    build_trace,
    max_long_bound,
    population,
    reuse_flags,
    working_set_bytes,
)
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit

CFG = TraceConfig(users=600, length=64, qps=40.0, warmup=50, measured=400, seed=5)


@pytest.fixture(scope="module")
def pop():
    return population(CFG.users, CFG.seed)


@pytest.fixture(scope="module")
def big():
    """Users to spare: a trace that needs many of them (sessions a TTL apart allow one per user and point)."""
    return population(2000, CFG.seed)


def test_bases_are_heavy_tailed_around_the_length_and_fixed_gives_one_length(pop):
    base = base_lengths(pop, CFG)
    assert np.median(base) == pytest.approx(CFG.length, rel=0.05)  # the median user has ``length``
    p10, p90 = np.quantile(base, [0.1, 0.9])
    assert p90 / p10 > 5  # lognormal sigma 1.0: about 13 (KuaiRand-like), not one length for every user
    assert base.mean() > 1.3 * np.median(base)  # right-skewed: the mean above the median
    heavier = np.diff(pop.offsets)  # heavier synthetic users have longer histories
    assert np.corrcoef(heavier, base)[0, 1] > 0.99
    assert set(base_lengths(pop, replace(CFG, length_dist="fixed")).tolist()) == {CFG.length}
    assert base_lengths(pop, replace(CFG, length=10_000, max_length=20_000)).max() == 20_000  # clipped


def test_visited_histories_differ_in_length_and_stay_under_the_models_bound(pop):
    trace = build_trace(pop, CFG)
    s = trace.shape
    assert s["length_dist"] == "kuairand" and s["user_long_term_len_p90"] > 2 * s["user_long_term_len_p50"]
    fixed = build_trace(pop, replace(CFG, length_dist="fixed"))
    assert fixed.shape["user_long_term_len_p90"] < 1.5 * fixed.shape["user_long_term_len_p50"]
    for q in (10.0, 80.0):
        assert build_trace(pop, replace(CFG, qps=q)).max_long <= max_long_bound(pop, CFG)


@pytest.mark.parametrize("follow", [0.8, 0.5])
def test_follow_through_rate_is_the_parameter_on_a_large_trace(pop, big, follow):
    cfg = replace(CFG, users=2000, measured=1500, follow_through=follow, qps=80.0)
    trace = build_trace(big, cfg)
    rate = np.mean([v.ranked for v in trace.visits])
    assert abs(rate - follow) < 0.04  # binomial sd 0.009-0.011 at these sizes
    assert trace.shape["ranked_fraction"] == pytest.approx(rate)
    assert sum(v.ranked for v in trace.visits[cfg.warmup:]) == cfg.measured  # the measured ranks still all come
    every = build_trace(pop, replace(CFG, follow_through=1.0))
    assert all(v.ranked for v in every.visits) and len(every.visits) == CFG.warmup + CFG.measured
    with pytest.raises(UserError):
        build_trace(pop, replace(CFG, follow_through=0.0))


@pytest.mark.parametrize("ttl", [2.0, 600.0])
def test_no_users_next_session_comes_sooner_than_the_dram_ttl(pop, ttl):
    cfg = replace(CFG, qps=10.0, dram_ttl_s=ttl)
    trace = build_trace(pop, cfg)
    last: dict[int, tuple[float, int]] = {}
    cross = []
    for v in trace.visits:
        if v.user in last and last[v.user][1] != v.session:
            cross.append(v.wall_s - last[v.user][0])
        last[v.user] = (v.wall_s, v.session)
    assert all(g >= ttl - 1e-9 for g in cross)
    if ttl < 10:  # a point of ~50 s holds several of a heavy user's sessions a short TTL apart
        assert cross and trace.shape["session_gap_wall_s_min"] == pytest.approx(min(cross))
    else:  # sessions a whole TTL apart do not fit in the point: no cross-session visit at all
        assert not cross and trace.shape["session_gap_wall_s_min"] is None
    # the point keeps its rate: no visit waits out a TTL for lack of other users
    assert len(trace.visits) / trace.visits[-1].wall_s > 0.7 * cfg.qps


def test_the_population_is_sized_to_the_cache_pressure(big):
    kv = 1032
    cfg = replace(CFG, users=2000)
    unsized = build_trace(big, cfg)
    device = working_set_bytes(*_users_and_lens(unsized), kv) // 5  # the unsized trace: 5x this device
    sized = build_trace(big, replace(cfg, kv_bytes_per_token=kv, device_cache_bytes=device, cache_pressure=10.0))
    s = sized.shape
    assert s["cache_pressure"] == pytest.approx(s["working_set_bytes"] / s["device_cache_bytes"])
    assert s["working_set_bytes"] == working_set_bytes(*_users_and_lens(sized), kv)
    assert s["cache_pressure"] >= 10.0 and s["cache_pressure_target"] == 10.0
    assert s["users"] > unsized.shape["users"]  # more users, fewer visits each
    # a pressure too high for this population: the trace still fills the point and says what it reached
    short = build_trace(big, replace(cfg, kv_bytes_per_token=kv, device_cache_bytes=device, cache_pressure=500.0))
    assert sum(v.ranked for v in short.visits[cfg.warmup:]) == cfg.measured
    assert 10.0 <= short.shape["cache_pressure"] < 500.0
    assert unsized.shape["cache_pressure"] is None  # unsized: no device given
    # sized at one length, a sweep's points replay the same visits with longer histories
    at = replace(cfg, kv_bytes_per_token=kv, device_cache_bytes=device, pressure_length=cfg.length)
    short_h, long_h = build_trace(big, at), build_trace(big, replace(at, length=4 * cfg.length))
    assert [(v.user, v.t) for v in short_h.visits] == [(v.user, v.t) for v in long_h.visits]
    assert long_h.shape["cache_pressure"] > 3 * short_h.shape["cache_pressure"]


def test_reuse_share_counts_repeat_visits_within_the_ttl_of_the_users_last_rank(pop):
    trace = build_trace(pop, CFG)
    flags = reuse_flags(trace)
    last: dict[int, float] = {}
    for v, f in zip(trace.visits, flags, strict=True):
        assert f == (v.user in last and v.wall_s - last[v.user] < CFG.dram_ttl_s)
        if v.ranked:
            last[v.user] = v.rank_s
    measured = [f for k, (v, f) in enumerate(zip(trace.visits, flags, strict=True)) if k >= CFG.warmup and v.ranked]
    assert trace.shape["reuse_share"] == pytest.approx(np.mean(measured))
    assert 0 < trace.shape["reuse_share"] < 1
    no_ttl = build_trace(pop, replace(CFG, dram_ttl_s=0.0))
    assert no_ttl.shape["reuse_share"] == 0.0  # nothing survives a zero TTL


def _users_and_lens(trace):
    return np.array([v.user for v in trace.visits]), np.array([len(v.long_items) for v in trace.visits])

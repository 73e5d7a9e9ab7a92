"""Cost profiles: the non-negative relative fit, the residual quantiles a simulator draws from, the JSON round trip,
and the paper-scale model's figures (0.2B HSTU, bf16, 4k prefixes, H200)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.serve import (
    CostModel,
    CostProfile,
    PaperScale,
    fit_hops,
    fit_requests,
    paper_scale_profile,
    with_host_costs,
)
from grstack.runtime.serve.cost_profile import LEVELS, STEP_FEATURES, fit, nnls
from grstack.runtime.serve.step_log import attention_pairs

pytestmark = pytest.mark.unit


def test_nnls_is_exact_when_the_truth_is_non_negative_and_clamps_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.uniform(0.1, 1.0, (40, 4))
    assert nnls(a, a @ np.array([1.0, 0.0, 2.0, 0.5])) == pytest.approx([1.0, 0.0, 2.0, 0.5], abs=1e-9)
    x = nnls(a, a @ np.array([1.0, -3.0, 2.0, 0.5]))
    assert (x >= 0).all()
    free = np.linalg.lstsq(a, a @ np.array([1.0, -3.0, 2.0, 0.5]), rcond=None)[0]
    assert free[1] < 0  # what an unconstrained fit would extrapolate with


def test_fit_weighs_steps_by_their_relative_miss() -> None:
    # small exact steps beside large ones 3% off: an absolute fit lets the large ones move the intercept
    ns = [1, 2, 3, 1000, 2000, 3000, 1500, 2500]
    noise = [1.0, 1.0, 1.0, 1.03, 0.97, 1.03, 0.97, 1.03]
    secs = [(1e-4 + 1e-6 * n) * f for n, f in zip(ns, noise, strict=True)]
    m = fit([{"tokens": n} for n in ns], secs, ("step", "tokens"))
    assert m.predict({"tokens": 2}) == pytest.approx(1.02e-4, rel=1e-3)
    absolute = np.linalg.lstsq(np.array([[1.0, n] for n in ns]), np.array(secs), rcond=None)[0]
    assert abs((absolute[0] + 2 * absolute[1]) / 1.02e-4 - 1) > 0.05
    with pytest.raises(ValueError, match="nothing to fit"):
        fit([{}], [0.0], ("step",))


def test_terms_the_data_cannot_tell_apart_go_to_the_constant() -> None:
    rows = [{"batch": 1, "tokens": n} for n in (10, 50, 90, 130)]  # every step has one user
    m = fit(rows, [2e-3 + 1e-5 * r["tokens"] for r in rows], STEP_FEATURES)
    assert m.coef[:3] == pytest.approx((2e-3, 0.0, 1e-5), rel=1e-6, abs=1e-12)


def profile() -> CostProfile:
    rng = np.random.default_rng(3)
    rows = [{"batch": int(b), "tokens": int(t), "context": int(c), "pairs": int(t * c)}
            for b, t, c in zip(rng.integers(1, 9, 80), rng.integers(10, 500, 80), rng.integers(0, 900, 80),
                               strict=True)]
    secs = [(1e-3 + 1e-4 * r["batch"] + 1e-6 * r["tokens"]) * rng.lognormal(0, 0.2) for r in rows]
    reqs = [{"endpoint": "rank", "events": int(e), "candidates": 64, "parse_s": 5e-5 + 1e-8 * e, "encode_s": 3e-5,
             "reply_s": 8e-5} for e in rng.integers(10, 2000, 30)]
    return CostProfile(source="calibrated", host={"cpu": "test"}, model={"name": "tiny"},
                       steps={"rank_cached": fit(rows, secs, STEP_FEATURES)}, requests=fit_requests(reqs),
                       hops=fit_hops({"harness": list(rng.uniform(1e-4, 3e-4, 50))}),
                       transfers={"host_to_device": 1e9}, notes="a test")


def test_profile_json_round_trip_keeps_every_model_and_its_tails(tmp_path: Path) -> None:
    p = profile()
    path = p.save(tmp_path / "sub" / "profile.json")
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and raw["source"] == "calibrated"
    assert set(raw["steps"]["rank_cached"]["residual"]) == {"p50", "p90", "p99", "max"}
    q = CostProfile.load(path)
    assert q.to_json() == p.to_json()
    sizes = {"batch": 3, "tokens": 200, "context": 100, "pairs": 20_000}
    for u in (0.0, 0.5, 0.99, 1.0):
        assert q.steps["rank_cached"].draw(u, sizes) == p.steps["rank_cached"].draw(u, sizes)
    assert q.step_s("rank_cached", 3, 200, 100, 20_000) == pytest.approx(p.steps["rank_cached"].predict(sizes))
    assert set(q.requests) == {"rank.parse", "rank.encode", "rank.reply"} and set(q.hops) == {"harness"}
    assert "startup" not in raw  # none measured: none written
    measured = [{"mode": "relay", "lengths": [32, 64], "full_ms": [1.0, 2.5], "cached_ms": [0.5, 0.6],
                 "prefill_ms": [0.8, 2.0]}]
    with_startup = CostProfile.from_json({**raw, "startup": measured})
    assert with_startup.startup == measured
    assert CostProfile.load(with_startup.save(tmp_path / "s.json")).startup == measured
    raw["version"] = 99
    with pytest.raises(ValueError, match="version 99"):
        CostProfile.from_json(raw)
    with pytest.raises(ValueError, match="source"):
        CostProfile(source="guess", host={}, model={}, steps={})


def test_a_model_written_at_other_levels_is_read_at_ours() -> None:
    m = CostModel.from_json({"features": ["hop"], "coef": [1e-3], "residual_levels": [0.0, 1.0],
                             "residual_quantiles": [-0.5, 0.5]})
    assert len(m.residuals) == len(LEVELS) and m.residual(0.5) == pytest.approx(0.0)
    assert m.draw(1.0) == pytest.approx(1.5e-3)


def test_paper_scale_figures_are_the_issues() -> None:
    s = PaperScale()
    assert s.kv_bytes_per_token == 2 * 1024 * 28 * 2 + 8
    assert s.prefix_bytes() / 1e9 == pytest.approx(0.47, abs=0.005)  # one 4k prefix in bf16
    assert s.prefill_flops() / 1e12 == pytest.approx(2.6, abs=0.05)  # its recompute
    assert 5e-3 < s.promotion_s() < 19e-3  # DRAM to device over PCIe Gen5 x16
    assert 240 <= s.resident_prefixes() <= 300  # what one H200 holds beside the weights
    p = paper_scale_profile()
    assert p.source == "model" and set(p.steps) == {"rank_cached", "rank_full", "extend_many"}
    n = s.prefix_tokens
    prefill = p.step_s("extend_many", 1, n, 0, attention_pairs([n], [0]))
    compute = s.prefill_flops() / (s.efficiency * s.peak_flops)
    assert compute < prefill < compute + 2e-3  # FLOP-bound, plus the weights' read and the launches
    hit = p.step_s("rank_cached", 1, 128, n, attention_pairs([128], [n]))
    assert hit > s.prefix_bytes() / s.hbm_bytes_per_s  # at least one read of the prefix's K/V
    assert hit < prefill / 5
    slower = paper_scale_profile(PaperScale(efficiency=0.2))  # the efficiency is a parameter, not a constant
    assert slower.step_s("extend_many", 1, n, 0, attention_pairs([n], [0])) > 1.8 * compute
    assert CostProfile.from_json(json.loads(json.dumps(p.to_json()))).to_json() == p.to_json()
    both = with_host_costs(p, profile())
    assert both.source == "model" and set(both.requests) == {"rank.parse", "rank.encode", "rank.reply"}
    assert both.steps == p.steps


def test_expected_cost_is_the_mean_of_the_draws() -> None:
    q = (-0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.1, 0.3, 0.5, 1.0, 2.0, 3.0)
    m = CostModel(STEP_FEATURES, (1e-3, 0.0, 1e-5, 0.0, 0.0, 0.0), q)
    sizes = {"tokens": 100}
    us = (np.arange(200_000) + 0.5) / 200_000
    assert m.expected(sizes) == pytest.approx(float(np.mean([m.draw(u, sizes) for u in us])), rel=1e-4)
    assert m.expected(sizes) > m.predict(sizes)  # the tail costs more than the median saves
    assert CostModel(STEP_FEATURES, m.coef).expected(sizes) == pytest.approx(m.predict(sizes))


def _profile() -> CostProfile:
    steps = {"extend_many": CostModel(STEP_FEATURES, (1e-3, 0.0, 2e-5, 0.0, 1e-8, 0.0),
                                      tuple(np.linspace(-0.2, 0.6, len(LEVELS)))),
             "rank_cached": CostModel(STEP_FEATURES, (1.5e-3, 0.0, 1e-5, 0.0, 1e-8, 5e-7))}
    return CostProfile(source="calibrated", host={}, model={}, steps=steps,
                       requests={"rank.parse": CostModel(("request", "events", "candidates"), (1e-4, 1e-6, 0.0))},
                       hops={"link": CostModel(("hop",), (1e-3,))})


def _steps(profile: CostProfile, slower: float) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(300):
        kind = ("extend_many", "rank_cached", "rank_full")[k % 3]
        r = {"kind": kind, "batch": 1, "tokens": int(rng.integers(1, 600)), "context": int(rng.integers(0, 900)),
             "pairs": int(rng.integers(0, 200_000)), "cold": 0}
        m = profile.steps.get(kind)
        r["seconds"] = 0.05 if m is None else slower * m.expected({f: r[f] for f in STEP_FEATURES[1:]})
        out.append(r)
    return out


def test_slowdown_measures_the_host_against_the_profile() -> None:
    p = _profile()
    assert p.slowdown(_steps(p, 1.0)) == (pytest.approx(1.0), 200)  # rank_full: not in the profile, not counted
    assert p.slowdown(_steps(p, 1.25))[0] == pytest.approx(1.25)
    assert p.slowdown([]) == (None, 0)


def test_a_scaled_profile_costs_the_factor_more_on_the_core_only() -> None:
    p = _profile()
    s = p.scaled(1.3)
    for kind in p.steps:
        assert s.step_s(kind, 2, 300, 700, 90_000, 0.9, 50) == pytest.approx(1.3 * p.step_s(kind, 2, 300, 700, 90_000,
                                                                                               0.9, 50))
    assert s.requests["rank.parse"].predict({"events": 500}) == pytest.approx(
        1.3 * p.requests["rank.parse"].predict({"events": 500}))
    assert s.hops["link"].predict() == p.hops["link"].predict()  # waits as much as work: kept
    assert s.slowdown(_steps(p, 1.3))[0] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="positive"):
        p.scaled(0.0)

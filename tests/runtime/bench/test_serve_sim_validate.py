"""The validation rules: a prediction within the measured repeats' spread, the knee within its bracket."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grstack.runtime.bench.serve_sim_validate import (
    HeldOutPoint,
    compare,
    knee_check,
    load_validation,
    summary,
)
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


def held(p99: float | None, lo: float | None, hi: float | None, **extra) -> HeldOutPoint:
    m = {"p99_ms": p99, "p99_ms_min": lo, "p99_ms_max": hi, "hit_rate": 0.9, "compute_ms_per_visit": 5.0,
         "n": 600, "errors_by_kind": {"shed_503": 6}, "trigger_decisions": {"admitted": 50, "not-at-risk": 50},
         **extra}
    return HeldOutPoint("relay", "qps", 512, 20.0, (1000, 1001, 1002), m)


def test_within_the_repeat_spread() -> None:
    pred = {"p99_ms": 30.0, "hit_rate": 0.91, "compute_ms_per_visit": 5.1, "n": 600,
            "errors_by_kind": {"shed_503": 7}, "trigger_decisions": {"admitted": 52, "not-at-risk": 48}}
    e = compare(held(31.0, 25.0, 40.0), pred, 100.0)
    assert e["within"] and e["point"] == "512@20"
    assert all(c["within"] for c in e["checks"].values())
    assert not compare(held(31.0, 25.0, 29.0), pred, 100.0)["within"]


def test_a_failed_measured_point_needs_a_failing_prediction() -> None:
    failed = held(None, 80.0, None)
    assert not compare(failed, {"p99_ms": 60.0}, 100.0)["within"]
    assert compare(failed, {"p99_ms": 130.0}, 100.0)["within"]


def test_secondary_checks_miss_beyond_five_percent() -> None:
    e = compare(held(31.0, 25.0, 40.0), {"p99_ms": 30.0, "hit_rate": 1.0, "compute_ms_per_visit": 4.0}, 100.0)
    assert e["checks"]["hit_rate"]["within"] is False
    assert e["checks"]["compute_ms_per_visit"]["within"] is False
    s = summary([e], [])
    assert not s["all_within"] and any("hit_rate" in m for m in s["misses"])


def test_knee_bracket() -> None:
    grid = [10.0, 20.0, 30.0, 45.0, 60.0]
    assert knee_check("relay", 45.0, grid, 52.0)["within"]
    assert knee_check("relay", 45.0, grid, 44.0)["within"]  # one 5 % step below the bracket
    assert not knee_check("relay", 45.0, grid, 66.0)["within"]
    assert not knee_check("relay", 45.0, grid, 40.0)["within"]
    assert knee_check("baseline", None, grid, None)["within"]


def test_missing_or_malformed_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"cost-profile\.json: no such file"):
        load_validation(tmp_path)
    (tmp_path / "cost-profile.json").write_text("{}")
    (tmp_path / "held-out.json").write_text(json.dumps({"protocol": {}}))
    with pytest.raises(UserError, match=r"held-out\.json: not a held-out"):
        load_validation(tmp_path)


def test_the_stored_runs_load() -> None:
    from grstack.runtime.bench.serve_simulate import VALIDATION_DIR
    from grstack.runtime.serve import CostProfile

    assert Path(__file__).resolve().parents[3] / "runtime" / "bench" / "serve_validation" == VALIDATION_DIR
    for directory, baseline_points in ((VALIDATION_DIR, 2), (VALIDATION_DIR / "intel-xeon-2026-12-06-0930", 2),
                                       (VALIDATION_DIR / "intel-xeon-2026-12-06", 2),
                                       (VALIDATION_DIR / "intel-xeon-2026-12-05", 2),
                                       (VALIDATION_DIR / "amd-epyc-2026-12-05", 3)):
        vs = load_validation(directory)
        assert vs.modes() == ["baseline", "relay"]
        assert len([p for p in vs.points if p.mode == "relay"]) >= 3
        # on the slower host full inference failed at 10 QPS and at the 5 QPS floor: two baseline points
        assert len([p for p in vs.points if p.mode == "baseline"]) >= baseline_points
        assert all(len(p.seeds) == 3 for p in vs.points)
    assert {s["mode"] for s in CostProfile.load(VALIDATION_DIR / "cost-profile.json").startup} == {"relay", "baseline"}
    # the current set carries its held-out run's steps: the host's speed during it is measured, every repeat's
    vs = load_validation(VALIDATION_DIR)
    assert {(r["mode"], r["qps"], r["repeat"]) for r in vs.step_log} >= {
        (p.mode, p.qps, k) for p in vs.points for k in range(3)}


def _with_step_log(tmp_path: Path, slower: dict[float, float]) -> Path:
    """The stored set's profile and held-out run, plus a step log whose repeat at each rate ran ``slower[qps]``
    times the profile's expected cost."""
    import shutil

    from grstack.runtime.bench.serve import step_columns, write_step_log
    from grstack.runtime.bench.serve_simulate import VALIDATION_DIR
    from grstack.runtime.serve import CostProfile
    from grstack.runtime.serve.cost_profile import STEP_FEATURES

    for f in ("cost-profile.json", "held-out.json"):
        shutil.copy(VALIDATION_DIR / f, tmp_path / f)
    profile = CostProfile.load(tmp_path / "cost-profile.json")
    repeats = []
    for qps, factor in slower.items():
        for mode in ("baseline", "relay"):
            steps = []
            for k in range(20):
                s = {"kind": ("extend_many", "rank_cached")[k % 2], "batch": 1, "tokens": 64 + 20 * k,
                     "context": 500, "pairs": 40_000 + 1000 * k, "cold": 500 * (k % 2), "cpu_seconds": None}
                s["seconds"] = factor * profile.steps[s["kind"]].expected({f: s[f] for f in STEP_FEATURES[1:]})
                steps.append(s)
            repeats.append({"mode": mode, "sweep": "length" if qps == 10.0 else "qps", "length": 512, "qps": qps,
                            "repeat": 0, "steps": step_columns(steps)})
    write_step_log(tmp_path / "held-out-steps.json.gz", repeats)
    return tmp_path


def test_the_host_speed_of_a_point_is_measured_on_the_held_out_runs_other_points(tmp_path: Path) -> None:
    from grstack.runtime.bench.serve_sim_validate import host_speed
    from grstack.runtime.serve import CostProfile

    vs = load_validation(_with_step_log(tmp_path, {10.0: 1.2, 20.0: 1.2, 30.0: 2.0}))
    profile = CostProfile.load(vs.profile_file)
    at = {p.qps: p for p in vs.points if p.mode == "relay"}
    assert len(vs.steps()) == 3 * 2 * 20 and len(vs.steps(at[30.0])) == 2 * 2 * 20
    # the judged point's own steps never count: 30 QPS's speed comes from 10 and 20 QPS, which ran 1.2x
    assert host_speed(vs, profile, at[30.0]) == {"factor": pytest.approx(1.2), "steps": 80, "left_out": "512@30"}
    assert host_speed(vs, profile, at[10.0])["factor"] == pytest.approx((1.2 + 2.0) / 2)  # the same steps at each
    assert host_speed(vs, profile)["steps"] == 120  # the knees: the whole run
    # without a stored step log: the calibration's speed
    (tmp_path / "held-out-steps.json.gz").unlink()
    assert host_speed(load_validation(tmp_path), profile, at[30.0]) is None


def test_the_own_point_diagnostic_takes_the_points_own_steps_and_leaves_its_compute_unjudged(tmp_path: Path) -> None:
    from grstack.runtime.bench.serve_sim_validate import compare, own_speed, summary, unjudge_compute
    from grstack.runtime.serve import CostProfile

    vs = load_validation(_with_step_log(tmp_path, {10.0: 1.2, 20.0: 1.2, 30.0: 2.0}))
    profile = CostProfile.load(vs.profile_file)
    at = {p.qps: p for p in vs.points if p.mode == "relay"}
    assert own_speed(vs, profile, at[30.0]) == {"factor": pytest.approx(2.0), "steps": 40, "only": "512@30"}
    entry = compare(at[30.0], {**at[30.0].measured, "compute_ms_per_visit": 1e6}, 100.0)
    assert summary([entry], [])["checks_judged"] == summary([unjudge_compute(entry)], [])["checks_judged"] + 1
    assert unjudge_compute(entry)["checks"]["compute_ms_per_visit"]["within"] is None
    assert not summary([unjudge_compute(entry)], [])["misses"]  # the same point, its compute not judged


def test_the_neighbours_speed_is_measured_on_the_repeats_nearest_in_time(tmp_path: Path) -> None:
    """Run order: 10 QPS (both modes, 1.2x), 20 QPS (1.2x), 30 QPS (2.0x). 20 QPS's nearest repeats are 10's and
    30's; 30 QPS's only 20's (nothing ran after it); a point is never measured on itself."""
    from grstack.runtime.bench.serve_sim_validate import neighbour_speed, point_speed
    from grstack.runtime.serve import CostProfile

    vs = load_validation(_with_step_log(tmp_path, {10.0: 1.2, 20.0: 1.2, 30.0: 2.0}))
    profile = CostProfile.load(vs.profile_file)
    at = {p.qps: p for p in vs.points if p.mode == "relay"}
    got = neighbour_speed(vs, profile, at[20.0])
    assert got is not None and got["factor"] == pytest.approx(1.6) and got["repeats"] == 4
    assert neighbour_speed(vs, profile, at[30.0])["factor"] == pytest.approx(1.2)
    assert neighbour_speed(vs, profile, at[20.0], k=1)["factor"] == pytest.approx(1.6)  # 10's relay, 30's baseline
    assert point_speed(vs, profile, at[30.0], "others")["factor"] == pytest.approx(1.2)
    assert point_speed(vs, profile, at[30.0], "own")["factor"] == pytest.approx(2.0)
    assert point_speed(vs, profile, at[30.0], "calibration") is None
    with pytest.raises(ValueError, match="host speed"):
        point_speed(vs, profile, at[30.0], "fastest")


def test_a_malformed_step_log_names_the_file(tmp_path: Path) -> None:
    _with_step_log(tmp_path, {10.0: 1.0})
    (tmp_path / "held-out-steps.json.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match=r"held-out-steps\.json\.gz: not a step log"):
        load_validation(tmp_path)


def test_a_validation_only_plot_is_its_one_panel(tmp_path: Path) -> None:
    import matplotlib.image

    from grstack.runtime.bench.serve_sim_plot import plot_simulation

    entry = {"mode": "relay", "point": "512@10", "p99_ms_measured_spread": [20.0, 30.0], "p99_ms_predicted": 25.0,
             "within": True}
    points = [{"sweep": sweep, "qps": 10.0, "length": 512, "p99_ms": 25.0, "p99_ms_lo": 20.0, "p99_ms_hi": 30.0}
              for sweep in ("length", "qps")]
    alone = matplotlib.image.imread(plot_simulation({"validation": [entry]}, tmp_path / "v.png"))
    whole = matplotlib.image.imread(plot_simulation({"validation": [entry], "scale": {"slo_ms": 100.0},
                                                     "modes": {"relay": {"points": points}}}, tmp_path / "s.png"))
    assert alone.shape[0] == whole.shape[0] and alone.shape[1] < whole.shape[1] / 2

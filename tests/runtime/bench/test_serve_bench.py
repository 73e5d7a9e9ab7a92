"""``grstack bench serve`` end to end on a tiny trace: every mode on rankers of its own, the modes' points
interleaved, the overload run, the score check and every JSON key the protocol promises."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

TINY = ["--users", "200", "--lengths", "48,64", "--qps", "40", "--length-qps", "40", "--qps-length", "48",
        "--measured", "30", "--warmup", "8", "--repeats", "1", "--qps-floor", "40", "--slo-ms", "5000",
        "--cascade-gap-ms", "20", "--min-user-gap-s", "0.2"]


def test_tiny_run_reports_every_mode_the_overload_run_and_the_score_check(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))  # rankers on the last CPU, the harness on the first, as on a test bed
    proc = subprocess.run([sys.executable, "-P", "-m", "grstack.runtime.cli", "bench", "serve", *TINY, "--out",
                           str(tmp_path), "--json", "--ranker-cpus", str(cpus[-1]), "--harness-cpus", str(cpus[0])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    proto = out["protocol"]
    assert proto["prefill_on_clock"] is True and proto["preload"] is False
    assert (proto["users"], proto["measured_requests_min"], proto["repeats"], proto["cascade_gap_ms"],
            proto["slo_ms"], proto["rankers"], proto["warmup_visits"]) == (200, 30, 1, 20.0, 5000.0, 2, 8)
    assert out["slo_ms"] == 5000.0
    assert (proto["ranker_cpus"], proto["harness_cpus"]) == (str(cpus[-1]), str(cpus[0]))
    # interleaved: every mode's 48-token point ran before any mode's 64-token point
    modes = (out["baseline"], out["prefix_cache"], out["relay"], *out["ablations"].values())
    started = {length: [p["started_s"] for m in modes for p in m["points"] if p["sweep"] == "length"
                        and p["length"] == length] for length in (48, 64)}
    assert proto["schedule"] == "interleaved" and len(started[48]) == len(started[64]) == 6
    assert max(started[48]) < min(started[64])
    for mode in modes:
        assert {"points", "max_len_at_slo", "max_qps_at_slo"} <= set(mode)
        assert all(p["n"] == p["planned"] == 30 and not p["stopped_early"] for p in mode["points"])
    assert set(out["ablations"]) == {"no_trigger", "no_affinity", "no_expander"}
    for ab in out["ablations"].values():
        assert "max_len_ratio" in ab and "slo_qps_ratio" in ab
    assert all(p["hit_rate"] in (0.0, None) for p in out["baseline"]["points"])  # relay off: every rank is full
    # relay against both baselines, with the same fields; the top-level ratios are relay_vs_full's
    assert set(out["relay_vs_full"]) == set(out["relay_vs_prefix_cache"]) == {"max_len_ratio", "slo_qps_ratio"}
    assert {k: out[k] for k in out["relay_vs_full"]} == out["relay_vs_full"]
    # pre-infer every visit: the signal 20 ms ahead finds (or is joined by) most ranks
    assert any((p["hit_rate"] or 0) > 0 for p in out["ablations"]["no_trigger"]["points"])
    for key in ("max_len_ratio", "slo_qps_ratio", "max_abs_score_diff"):
        assert key in out
    for key in ("hit_rate", "prefill_cpu_share", "device_bytes", "dram_bytes"):
        assert key in out["relay"]
    assert set(out["prefill_tokens"]) == {"computed", "without_incremental"}
    assert {"offered_qps", "served_qps", "shed_fraction", "p99_ms_served", "errors_other"} <= set(out["overload"])
    assert out["overload"]["n"] == 30
    for mode in ("baseline", "relay"):  # the rankers' measured compute bounds the QPS they can serve at all
        cap = out["capacity"][mode]
        assert cap["compute_ms_per_visit"] > 0
        assert cap["ceiling_qps"] == pytest.approx(2 * 1000.0 / cap["compute_ms_per_visit"])
    assert all(p["compute_ms_per_visit"] > 0 for p in out["relay"]["points"])
    # where each point's CPU went: the measured mode's rankers computed; the host was busy at least that much
    for p in out["relay"]["points"] + out["baseline"]["points"] + [out["overload"]]:
        cpu = p["host_cpu"]
        assert cpu["cores"] >= 1 and cpu["rankers"] > 0 and cpu["harness"] > 0
        assert cpu["busy"] >= 0.9 * (cpu["rankers"] + cpu["harness"])
    assert out["host_cpu_before"]["busy"] is not None
    for p in out["relay"]["points"] + [out["overload"]]:  # garbage-collector pauses: rankers' and the harness's
        g = p["gc_pauses"]
        assert set(g) == {"rankers", "harness"} and g["harness"]["count"] >= 0
        assert g["rankers"]["count"] >= g["rankers"]["over_25ms"] >= g["rankers"]["over_50ms"] >= 0
    # every relay visit's signal was decided by the trigger, and the point says how
    assert all(sum(p["trigger_decisions"].values()) >= 38 for p in out["relay"]["points"])
    for base in ("baseline", "prefix_cache"):  # relay off: no signal pre-infers anything
        assert all(set(p["trigger_decisions"]) <= {"disabled"} for p in out[base]["points"])
    assert out["capacity"]["slo_qps_ratio_bound"] == pytest.approx(
        out["capacity"]["relay"]["ceiling_qps"] / out["baseline"]["max_qps_at_slo"])
    assert {"users", "top1pct_population_visit_share", "prefix_grew_fraction", "reuse_share", "cache_pressure",
            "follow_through", "session_gap_wall_s_min"} <= set(out["trace"])
    assert out["trace"]["ranked_fraction"] < 1.0 and proto["follow_through"] == 0.8 and proto["dram_ttl_s"] == 600
    assert "reuse_share" in out["relay"] and all("reuse_share" in p for p in out["prefix_cache"]["points"])
    # relay cache hits (topped up by no_trigger's) recomputed by full inference in fp32
    assert out["score_diff_samples"]["n"] > 0 and out["max_abs_score_diff"] <= 1e-4
    assert (tmp_path / "serve-p99.png").stat().st_size > 0
    saved = json.loads((tmp_path / "serve-bench.json").read_text())
    assert "repeats" in saved["relay"]["points"][0]  # the file keeps the per-repeat details
    # every sweep repeat's logged steps, beside the results: what a simulator's validation measures the host on
    from pathlib import Path

    from grstack.runtime.bench.serve import read_step_log_file, step_rows

    log = read_step_log_file(Path(tmp_path) / "serve-bench-steps.json.gz")
    ran = {(m, p["sweep"], p["length"], p["qps"]) for m in ("baseline", "prefix_cache", "relay", *out["ablations"])
           for p in (out[m] if m in out else out["ablations"][m])["points"] if not p.get("shared_with")}
    assert {(r["mode"], r["sweep"], r["length"], r["qps"]) for r in log} == ran
    for r in log:
        rows = step_rows(r["steps"])
        assert rows and all(s["seconds"] > 0 and s["tokens"] > 0 for s in rows)
        kinds = {s["kind"] for s in rows}
        # no warm-up or start-up profile: the baseline's visits are full inference, split as the scheduler runs it
        assert kinds <= {"extend_many", "rank_cached", "rank_full"}

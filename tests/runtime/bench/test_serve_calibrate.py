"""``grstack bench serve --calibrate`` on a tiny trace: the real rankers and router at two load points, and a cost
profile of every step kind, the request CPU and the hops fitted to what they logged, written and printed."""

import json
import subprocess
import sys

import pytest

from grstack.runtime.serve import CostProfile

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TINY = ["--quick", "--calibrate-points", "48:20,300:20", "--users", "200", "--measured", "40", "--warmup", "10",
        "--cascade-gap-ms", "20", "--min-user-gap-s", "0.2"]


def test_calibrate_writes_and_prints_a_profile_of_what_the_rankers_logged(tmp_path):
    path = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-P", "-m", "grstack.runtime.cli", "bench", "serve", "--calibrate",
                           str(path), *TINY, "--out", str(tmp_path / "work")], capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(path.read_text())
    p = CostProfile.load(path)
    assert p.source == "calibrated" and p.version == 1
    assert [(pt["length"], pt["qps"], pt["n"]) for pt in p.host["points"]] == [(48, 20.0, 40), (300, 20.0, 40)]
    assert p.host["cores"] >= 1 and p.host["torch"]
    for pt in p.host["points"]:  # each step's compute-thread CPU beside its seconds, per kind and point
        assert pt["steps_wall_over_cpu"] and set(pt["steps_wall_over_cpu"]) <= {"rank_cached", "rank_full",
                                                                                  "extend_many"}
        for k in pt["steps_wall_over_cpu"].values():
            assert k["steps"] > 0 and k["cpu_s"] > 0 and k["ratio"] == pytest.approx(k["wall_s"] / k["cpu_s"])
            assert k["ratio"] > 0.9  # one thread's CPU cannot outrun the wall clock (timer granularity aside)
        assert pt["compute_over_steps"] is not None and pt["compute_over_steps"] > 0.5
    assert set(p.steps) == {"rank_cached", "rank_full", "extend_many"}  # relay: prefills, hits and short misses
    for m in p.steps.values():
        assert m.samples > 0 and all(c >= 0 for c in m.coef) and m.predict({"batch": 1, "tokens": 64, "context": 64, "pairs": 4096}) > 0
        tails = m.tails()
        assert tails["p50"] <= tails["p90"] <= tails["p99"] <= tails["max"]
    assert {"rank.parse", "rank.encode", "rank.reply"} <= set(p.requests)
    answered = sum(pt["n"] - sum(pt["errors_by_kind"].values()) for pt in p.host["points"])  # measured ones
    assert set(p.hops) == {"harness", "router", "link"}
    hops = {m.samples for m in p.hops.values()}
    assert len(hops) == 1 and answered <= hops.pop() <= 2 * 50  # every answered rank (warm-up too) had its headers
    assert p.requests["rank.parse"].samples >= answered
    # each real ranker's start-up latency profile, as GET /v1/profile answered it (what the trigger reads)
    assert len(p.startup) == p.host["rankers"] and {s["mode"] for s in p.startup} == {"relay"}
    for startup in p.startup:
        assert startup["lengths"] == sorted(startup["lengths"]) and len(startup["full_ms"]) == len(startup["lengths"])
        assert all(v > 0 for v in startup["full_ms"] + startup["cached_ms"] + startup["prefill_ms"])
    log = json.loads((tmp_path / "profile-log.json").read_text())  # what it was fitted to, for refits
    assert len(log["steps"]) >= sum(m.samples for m in p.steps.values()) > 0  # (a 0 s step is not fitted)
    assert {s["kind"] for s in log["steps"]} == set(p.steps)

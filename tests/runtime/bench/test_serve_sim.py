"""The simulator: the real control plane on virtual time, the tensor math charged from a cost profile."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from grstack.runtime.bench import serve_simulate as ss
from grstack.runtime.bench.serve_sim import Deployment, SimulatedDeployment, measure_point
from grstack.runtime.serve.cost_profile import STEP_FEATURES, CostModel, CostProfile
from grstack.runtime.serve.step_log import attention_pairs
from grstack.runtime.serve.virtual_time import run_virtual

pytestmark = pytest.mark.integration

# a profile with known costs and no spread (every step's logged seconds must be its prediction), in which full
# inference of a 256-event history is slow enough (about 40 ms) for the trigger to pre-infer it
STEPS = {"rank_cached": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 1e-8, 5e-9, 0.0)),
         "rank_full": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 0.0, 1.2e-6, 0.0)),
         "extend_many": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 1e-8, 1e-7, 0.0))}
PROFILE = CostProfile(source="calibrated", host={}, model={}, steps=STEPS)


def settings(tmp_path: Path, qps: float = 20.0) -> ss.SimSettings:
    return ss.SimSettings(users=400, lengths=[256], length_qps=qps, qps=[qps], qps_length=256, repeats=1,
                          slo_ms=100.0, gap_ms=50.0, measured=120, warmup=30, seed=3, out=tmp_path, rankers=2,
                          trace_kind="uniform")


def point(tmp_path: Path, mode: str, tails: bool = False,
          profile: CostProfile = PROFILE) -> tuple[dict, list[dict], float]:
    s = settings(tmp_path)
    model, tasks, max_len = ss._model(s)
    dep = Deployment(replicas=2, servers=1, device_cache_mb=64, dram_mb_per_server=512)

    async def main() -> tuple[dict, list[dict], float]:
        d = SimulatedDeployment(mode, dep, profile, model, tasks, 100.0, max_len, seed=5, tails=tails)
        await d.start()
        p = await measure_point(d, s.trace(256, 20.0, 0), "t", 100.0, whole=True)
        steps = [r.model_dump() for svc in d.services.values() for r in svc.steps_since(0, 0).steps]
        now = asyncio.get_running_loop().time()
        await d.stop()
        return p, steps, now

    return run_virtual(main)


def test_every_logged_step_costs_what_the_profile_predicts_for_its_logged_sizes(tmp_path: Path) -> None:
    _, steps, _ = point(tmp_path, "relay")
    assert steps and {s["kind"] for s in steps} >= {"rank_cached", "extend_many"}
    for s in steps:
        sizes = {"batch": s["batch"], "tokens": s["tokens"], "context": s["context"], "pairs": s["pairs"]}
        assert s["seconds"] == pytest.approx(STEPS[s["kind"]].predict(sizes), rel=1e-6, abs=1e-9)
        assert s["pairs"] >= attention_pairs([s["tokens"] // max(1, s["batch"])], [0])  # at least the new tokens'



def test_a_relay_point_hits_and_the_baseline_never_does(tmp_path: Path) -> None:
    relay, _, now = point(tmp_path, "relay")
    base, _, _ = point(tmp_path, "baseline")
    assert relay["n"] == base["n"] == 120
    assert relay["hit_rate"] > 0.5 and base["hit_rate"] == 0.0
    assert relay["compute_ms_per_visit"] < base["compute_ms_per_visit"]
    assert base["trigger_decisions"] == {"disabled": sum(base["trigger_decisions"].values())}
    assert math.isfinite(relay["p99_ms"]) and relay["p99_ms"] < base["p99_ms"]
    assert now > 120 / 20.0  # the trace's span passed on the virtual clock


def test_the_same_seed_gives_the_same_point(tmp_path: Path) -> None:
    a, _, _ = point(tmp_path, "relay", tails=True)
    b, _, _ = point(tmp_path, "relay", tails=True)
    assert a["latencies_ms"] == b["latencies_ms"]


def test_a_calibrated_start_up_profile_is_what_the_trigger_reads(tmp_path: Path) -> None:
    # the same costs, but the real rankers measured full inference at start-up as fast: no prefix is at risk, so
    # nothing is pre-inferred; a rank hits only a prefix an earlier visit's miss left cached
    fast = [{"mode": "relay", "lengths": [32, 4096], "full_ms": [0.01, 0.02], "cached_ms": [0.01, 0.01],
             "prefill_ms": [0.01, 0.02]}]
    relay, _, _ = point(tmp_path, "relay", profile=CostProfile(source="calibrated", host={}, model={}, steps=STEPS,
                                                               startup=fast))
    assert relay["trigger_decisions"] == {"not-at-risk": sum(relay["trigger_decisions"].values())}
    assert relay["hit_rate"] < point(tmp_path, "relay")[0]["hit_rate"]
    assert relay["hit_rate"] <= relay["trace"]["repeat_visit_fraction"]


def test_start_up_curves_are_cut_and_interpolated_at_the_simulated_rankers_longest_length() -> None:
    from grstack.runtime.bench.serve_sim import startup_profile
    from grstack.runtime.serve.schemas import Profile

    own = Profile(replica="r", max_len=600, max_suffix=64, max_candidates=64, candidates=64, lengths=[32, 64, 536],
                  full_ms=[9.0, 9.0, 9.0], cached_ms=[9.0, 9.0, 9.0], prefill_ms=[9.0, 9.0, 9.0],
                  kv_bytes_per_token=8, tasks=["next"], num_items=10)
    real = [{"mode": "baseline", "lengths": [32, 64], "full_ms": [5.0, 5.0], "cached_ms": [5.0, 5.0],
             "prefill_ms": [5.0, 5.0]},
            {"mode": "relay", "lengths": [32, 256, 1024], "full_ms": [1.0, 2.0, 10.0], "cached_ms": [0.5, 0.5, 0.7],
             "prefill_ms": [0.8, 1.5, 8.0]}]
    got = startup_profile(own, real, "relay", 3)
    assert got.lengths == [32, 256, 536] and got.replica == "r" and got.max_len == 600
    assert got.full_ms == pytest.approx([1.0, 2.0, 2.0 + 8.0 * 280 / 768])
    short = startup_profile(own.model_copy(update={"lengths": [32, 2048]}), real, "relay", 0)
    assert short.lengths == [32, 256, 1024]  # the real ranker's profile stopped there (its cap): so does this one
    assert startup_profile(own, real, "no_trigger", 2).full_ms == [5.0, 5.0]  # no ranker of that mode: any


def test_plan_needs_a_rate() -> None:
    import argparse

    from grstack.runtime.errors import UserError

    args = argparse.Namespace(qps=None)
    with pytest.raises(UserError, match="--plan: --qps"):
        run_virtual(lambda: ss.plan_part(args, True))


def test_random_routing_repeats_with_the_seed(tmp_path: Path) -> None:
    a, _, _ = point(tmp_path, "no_affinity", tails=True)
    b, _, _ = point(tmp_path, "no_affinity", tails=True)
    assert a["latencies_ms"] == b["latencies_ms"]


def test_a_point_runs_on_the_costs_it_is_given(tmp_path: Path) -> None:
    s = settings(tmp_path)
    model, tasks, max_len = ss._model(s)
    dep = Deployment(replicas=2, servers=1, device_cache_mb=64, dram_mb_per_server=512)
    sim = ss.Simulator(s, dep, PROFILE, model, tasks, max_len, tails=False, whole=True)

    async def main() -> tuple[dict, dict]:
        return (await sim.run("relay", "qps", 256, 20.0, [3]),
                await sim.run("relay", "qps", 256, 20.0, [3], profile=PROFILE.scaled(2.0)))

    base, slow = run_virtual(main)
    # a host twice as slow: every step twice the seconds (batching may differ a little under the longer queue)
    assert slow["compute_ms_per_visit"] == pytest.approx(2 * base["compute_ms_per_visit"], rel=0.1)
    assert slow["p99_ms"] > base["p99_ms"]


def test_on_an_accelerator_the_math_does_not_wait_for_request_cpu(tmp_path: Path) -> None:
    # every request's parse costs 8 ms of the host core: on one CPU core the steps queue behind the parses
    # (and the parses behind the steps); with the math on an accelerator of its own they overlap
    parse = {"rank.parse": CostModel(("request", "events", "candidates"), (8e-3, 0.0, 0.0)),
             "prefill.parse": CostModel(("request", "events", "candidates"), (8e-3, 0.0, 0.0))}
    profile = CostProfile(source="calibrated", host={}, model={}, steps=STEPS, requests=parse)
    s = settings(tmp_path, qps=40.0)
    model, tasks, max_len = ss._model(s)

    def p99(accelerator: bool) -> float:
        dep = Deployment(replicas=2, servers=1, device_cache_mb=64, dram_mb_per_server=512, accelerator=accelerator)
        sim = ss.Simulator(s, dep, profile, model, tasks, max_len, tails=False, whole=True)
        return run_virtual(lambda: sim.run("relay", "qps", 256, 40.0, [3]))["p99_ms"]

    assert p99(True) < 0.8 * p99(False)
    assert ss.paper_deployment(ss.load_profile("paper"), 2, 1, None, None).accelerator


@pytest.mark.parametrize("flags, message", [
    (["--speed", "own", "--calibration-speed"], "--calibration-speed and --speed own"),
    (["--validation-only", "--no-validation"], "--validation-only and --no-validation"),
    (["--shared-cores", "--cores", "fcfs"], "--shared-cores and --cores fcfs"),
])
def test_contradictory_validation_flags_are_one_error_line(capsys, tmp_path: Path, flags: list[str],
                                                           message: str) -> None:
    from grstack.runtime.cli import main

    assert main(["bench", "serve", "--simulate", *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_a_simulated_router_has_read_every_rankers_load_before_its_points_traffic(tmp_path: Path) -> None:
    """As the real benchmark's router, up through the whole sweep, always has: without two load reports its
    trigger judges risk by the idle time and refuses at-risk signals the real one admits."""
    s = settings(tmp_path)
    model, tasks, max_len = ss._model(s)
    dep = Deployment(replicas=2, servers=1, device_cache_mb=64, dram_mb_per_server=512)

    async def main() -> list[float | None]:
        d = SimulatedDeployment("relay", dep, PROFILE, model, tasks, 100.0, max_len, seed=5)
        await d.start()
        trigger = d.router.trigger
        busy = [trigger._fresh_load(url, trigger.clock()).busy_fraction for url in d.services]
        await d.stop()
        return busy

    assert run_virtual(main) == [0.0, 0.0]  # read, and idle

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
STEPS = {"rank_cached": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 1e-8, 5e-9)),
         "rank_full": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 0.0, 1.2e-6)),
         "extend_many": CostModel(STEP_FEATURES, (1e-3, 1e-5, 2e-6, 1e-8, 1e-7))}
PROFILE = CostProfile(source="calibrated", host={}, model={}, steps=STEPS)


def settings(tmp_path: Path, qps: float = 20.0) -> ss.SimSettings:
    return ss.SimSettings(users=400, lengths=[256], length_qps=qps, qps=[qps], qps_length=256, repeats=1,
                          slo_ms=100.0, gap_ms=50.0, measured=120, warmup=30, seed=3, out=tmp_path, rankers=2,
                          trace_kind="uniform")


def point(tmp_path: Path, mode: str, tails: bool = False) -> tuple[dict, list[dict], float]:
    s = settings(tmp_path)
    model, tasks, max_len = ss._model(s)
    dep = Deployment(replicas=2, servers=1, device_cache_mb=64, dram_mb_per_server=512)

    async def main() -> tuple[dict, list[dict], float]:
        d = SimulatedDeployment(mode, dep, PROFILE, model, tasks, 100.0, max_len, seed=5, tails=tails)
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


def test_plan_needs_a_rate() -> None:
    import argparse

    from grstack.runtime.errors import UserError

    args = argparse.Namespace(qps=None)
    with pytest.raises(UserError, match="--plan: --qps"):
        run_virtual(lambda: ss.plan_part(args, True))

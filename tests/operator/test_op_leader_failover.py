"""Leader failover: two ``grstack operator`` replicas share a ClusterKopfPeering; the higher priority one
works, the other stands by. When the leader dies without a word (SIGKILL, as a node loss), the standby takes
over once the leader's peering entry lapses and finishes the running job without disturbing its workers."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from opsim import Cluster

from grstack.operator import names

pytestmark = pytest.mark.e2e

JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"
PEERINGS = "kopf.dev/v1/clusterkopfpeerings"
FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]
LIFETIME_S = 10  # the peering lease: how long the standby waits for a silent leader


def peering_args(priority: int) -> list[str]:
    return ["--peering", "grstack", "--priority", str(priority), "--peering-lifetime-s", str(LIFETIME_S)]


def job(name: str) -> dict[str, Any]:
    env = {"FAKE_STEPS": "400", "FAKE_STEP_SECONDS": "0.1"}  # long enough to outlive the leader's lease
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "grstack:test", "progressIntervalSeconds": 1, "checkpoint": {"claimName": "ckpt"},
                     "workers": {"replicas": 2, "env": [{"name": k, "value": v} for k, v in env.items()]}}}


def status(c: Cluster, name: str) -> dict[str, Any]:
    return (c.get(JOBS, name) or {}).get("status") or {}


def peers(c: Cluster) -> dict[str, Any]:
    obj = next((p for p in c.server.live(PEERINGS) if p["metadata"]["name"] == "grstack"), None)
    return (obj or {}).get("status") or {}


async def test_standby_takes_over_a_running_job_when_the_leader_is_killed(tmp_path: Path) -> None:
    async with Cluster.start(tmp_path, command_map={"grstack": FAKE_TRAINER}) as c:
        code, body = await c.request("POST", "/apis/kopf.dev/v1/clusterkopfpeerings",
                                     {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                      "metadata": {"name": "grstack"}})
        assert code in (200, 201), body
        async with c.operator(extra_args=peering_args(100), log_name="leader.log") as leader, \
                c.operator(extra_args=peering_args(1), log_name="standby.log") as standby:
            await c.wait_for("both replicas in the peering", lambda: len(peers(c)) == 2)
            assert sorted(p["priority"] for p in peers(c).values()) == [1, 100]
            code, body = await c.apply(job("ha"))  # the leader creates its pods
            assert code in (200, 201), body
            await c.wait_for("Running with progress", lambda: status(c, "ha").get("state") == "Running"
                             and (status(c, "ha").get("progress") or {}).get("step", 0) > 0)
            pods_before = {p["metadata"]["name"] for p in c.pods(names.LABEL_JOB, "ha")}
            assert len(pods_before) == 2
            quiet = standby.log.read_text()  # the standby handled nothing while the leader lived
            assert "kopf.objects" not in quiet and "Resuming operations" not in quiet

            os.killpg(leader.proc.pid, signal.SIGKILL)
            await leader.proc.wait()
            await c.wait_for("the standby resuming", lambda: "Resuming operations" in standby.log.read_text(),
                             timeout=120)
            await c.wait_for("Succeeded", lambda: status(c, "ha").get("state") == "Succeeded", timeout=180)

            st = status(c, "ha")
            assert st["restarts"] == 0 and st["progress"]["step"] == 400
            assert "Restarting" not in c.states(JOBS, "ha")
            pods = c.pods(names.LABEL_JOB, "ha")
            pod_names = [p["metadata"]["name"] for p in pods]
            assert len(pod_names) == len(set(pod_names)) == 2 and set(pod_names) == pods_before
            assert {p["metadata"]["labels"][names.LABEL_ATTEMPT] for p in pods} == {"0"}  # the first attempt still
            took_over = standby.log.read_text()  # kopf resumed the running job in the standby
            assert "Resuming is processed: 1 succeeded" in took_over
            assert "'build_registry.<locals>.training_changed' succeeded" in took_over
            assert leader.proc.returncode == -signal.SIGKILL

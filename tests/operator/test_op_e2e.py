"""End to end with the real trainer: a GRTrainingJob on the tiny synthetic config, reconciled by
``grstack operator`` against KMock, its pod run by the local kubelet as ``grstack train``.

Two workers: each pod is one rank of ``grstack train`` (torchrun environment from the operator, rank 0's
address mapped to 127.0.0.1 by the kubelet), so the gang restart really tears down a live peer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from opsim import Cluster

from grstack.operator import names

pytestmark = pytest.mark.e2e

WORKERS = 2
JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"
FAST = {  # the tiny synthetic demo config, made smaller: seconds per run on a loaded 2-core machine
    "train.batch_size": 8, "train.num_threads": 1, "train.log_every": 5, "train.epochs": 50,
    "train.eval_every_epochs": 1000, "model.d_model": 16, "model.dqk": 8, "model.dv": 8, "loss.negatives": 16,
    "data.max_len": 16,
}


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster.start(tmp_path) as c, c.operator():
        yield c


def training_job(name: str, steps: int, interval: int) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "grstack:cpu", "workers": {"replicas": WORKERS, "env": [{"name": "OMP_NUM_THREADS",
                                                                                        "value": "1"}]},
                     "maxSteps": steps, "checkpoint": {"claimName": "runs", "intervalSteps": interval},
                     "overrides": FAST, "progressIntervalSeconds": 1}}


def status(c: Cluster, name: str) -> dict[str, Any]:
    return (c.get(JOBS, name) or {}).get("status") or {}


def reported_steps(c: Cluster, pod: str) -> list[list[int]]:
    """Steps rank 0 reported, per pod incarnation (from KMock's history of the pod object)."""
    import json

    runs: list[list[int]] = [[]]
    for version in c.server.objects[(kmock.resource("v1/pods"), "default", pod)].history:
        if version is None:
            runs.append([])
            continue
        raw = (version.raw.get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_PROGRESS)
        if raw:
            step = json.loads(raw)["step"]
            if not runs[-1] or runs[-1][-1] != step:
                runs[-1].append(step)
    return [r for r in runs if r]


async def test_trains_to_succeeded_with_progress(real: Cluster) -> None:
    code, body = await real.apply(training_job("e2e", steps=120, interval=40))
    assert code in (200, 201), body
    await real.wait_for("Succeeded", lambda: status(real, "e2e").get("state") in ("Succeeded", "Failed"),
                        timeout=180)
    st = status(real, "e2e")
    assert st["state"] == "Succeeded", (st, real.kubelet.logs("e2e-worker-0")[-3000:],
                                        real.kubelet.logs("e2e-worker-1")[-3000:])
    progress = st["progress"]
    assert progress["step"] == progress["totalSteps"] == 120
    assert progress["loss"] > 0 and progress["samplesPerSecond"] > 0 and progress["tokensPerSecond"] > 0
    assert "checkpoints" in progress["lastCheckpoint"]
    assert set(progress["metrics"]) >= {"hr@10", "ndcg@10", "mrr"}
    run = real.root / "pvc" / "default" / "runs" / "e2e"
    assert (run / "summary.json").is_file() and (run / "metrics.jsonl").is_file()


async def test_killed_worker_restarts_and_resumes_from_the_checkpoint(real: Cluster) -> None:
    code, body = await real.apply(training_job("resume", steps=600, interval=50))
    assert code in (200, 201), body
    await real.wait_for("a checkpoint", lambda: (status(real, "resume").get("progress") or {}).get("lastCheckpoint"),
                        timeout=180)
    real.kubelet.kill("resume-worker-1")  # rank 1 dies; rank 0 would wait for it forever
    await real.wait_for("Restarting", lambda: "Restarting" in real.states(JOBS, "resume"))
    await real.wait_for("Succeeded", lambda: status(real, "resume").get("state") in ("Succeeded", "Failed"),
                        timeout=240)
    st = status(real, "resume")
    assert st["state"] == "Succeeded", (st, real.kubelet.logs("resume-worker-1")[-3000:])
    total = st["progress"]["totalSteps"]
    assert st["restarts"] == 1 and st["progress"]["step"] == total
    first, second = reported_steps(real, "resume-worker-0")
    assert second[0] > 50  # resumed from a checkpoint (the first is at step 50): a fresh run would report 5
    assert second[-1] == total and first[-1] < total

"""End to end: a GRRankingService reconciled by ``grstack operator`` against the emulator, its rankers and
router made into pods by the emulator's StatefulSet and Deployment controllers (opsim_controllers.py) and run by
the local kubelet as ``grstack serve ranker`` / ``grstack serve router`` on a tiny exported model; Ready comes
from the pods' readiness probes through the controllers' status, not from a test writing it, and one rank
request goes to the router through its Service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opsim import Cluster

from grstack.operator import names

pytestmark = pytest.mark.e2e

SERVICES = f"{names.GROUP}/{names.VERSION}/{names.SERVING_PLURAL}"


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with Cluster.start(tmp_path, controllers=True) as c, c.operator():
        yield c


def ranking_service(name: str, resources: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "grstack:cpu", "checkpoint": {"claimName": "models", "path": "/models/model.pt"},
                     "cache": {"deviceBytes": 16 << 20, "dramBytes": 16 << 20},
                     "ranker": {"resources": resources, "env": [{"name": "OMP_NUM_THREADS", "value": "1"}]}}}


def ready_condition(c: Cluster, name: str) -> dict[str, Any]:
    conds = ((c.get(SERVICES, name) or {}).get("status") or {}).get("conditions") or []
    return next((x for x in conds if x.get("type") == "Ready"), {})


def logs(c: Cluster) -> str:
    return "\n".join(f"--- {p['metadata']['name']}\n{c.kubelet.logs(p['metadata']['name'])[-2000:]}"
                     for p in c.server.live("v1/pods"))


async def start_service(c: Cluster, name: str, resources: dict[str, Any], **spec: Any) -> None:
    """The tiny exported model on the ``models`` claim, the service applied, and Ready waited for."""
    from grstack.runtime.serve.artifact import write_untrained_model

    model = c.root / "pvc" / "default" / "models" / "model.pt"
    if not model.exists():
        write_untrained_model(model, num_items=300, max_len=48, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8)
    manifest = ranking_service(name, resources)
    manifest["spec"].update(spec)
    code, body = await c.apply(manifest)
    assert code in (200, 201), body
    try:
        await c.wait_for("Ready", lambda: ready_condition(c, name).get("status") == "True", timeout=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {ready_condition(c, name)}\n{logs(c)}") from None


RESOURCES = [
    ("canonical", {"requests": {"cpu": "500m", "memory": "1Gi"}}, {"requests": {"cpu": "500m", "memory": "1Gi"}}),
    ("non-canonical", {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"cpu": "1000m", "memory": "4096Mi"}},
     {"requests": {"cpu": "500m", "memory": "1536Mi"}, "limits": {"cpu": "1", "memory": "4Gi"}}),
]


@pytest.mark.parametrize(("case", "resources", "stored"), RESOURCES, ids=[r[0] for r in RESOURCES])
async def test_ranking_service_reaches_ready_and_ranks_through_its_service(
        real: Cluster, case: str, resources: dict[str, Any], stored: dict[str, Any]) -> None:
    await start_service(real, "rank", resources)
    ranker = real.get("v1/pods", "rank-ranker-0")
    assert ranker is not None and ranker["spec"]["hostname"] == "rank-ranker-0"
    assert ranker["spec"]["subdomain"] == "rank-ranker"
    assert ranker["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
    assert ranker["spec"]["containers"][0]["resources"] == stored  # as the API server stores them
    sts = real.get("apps/v1/statefulsets", "rank-ranker")
    assert sts is not None and sts["status"]["readyReplicas"] == 1
    assert sts["status"]["observedGeneration"] == sts["metadata"]["generation"]
    routers = [p for p in real.server.live("v1/pods") if p["metadata"]["name"].startswith("rank-router-")]
    assert len(routers) == 1 and routers[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    port = real.kubelet.network.service_endpoint("default", "rank", 8080)
    assert port is not None, "the router Service has no ready endpoint"
    request = {"user_id": "e2e", "long_term": {"items": [1, 2, 3, 4, 5], "timestamps": [1, 2, 3, 4, 5]},
               "short_term": {"items": [6], "timestamps": [6]}, "candidates": [7, 8, 9]}
    async with aiohttp.ClientSession() as http, http.post(f"http://127.0.0.1:{port}/v1/rank", json=request,
                                                          timeout=aiohttp.ClientTimeout(total=60)) as resp:
        text = await resp.text()
    assert resp.status == 200, (text, logs(real))
    answer = json.loads(text)
    assert len(answer["scores"]) == 3, answer
    # Settled: the operator sees its StatefulSet as it wants it (quantities compared by value), so a few
    # more reconcile passes (1 s resync) patch nothing.
    await asyncio.sleep(3)
    assert real.get("apps/v1/statefulsets", "rank-ranker")["metadata"]["generation"] == sts["metadata"]["generation"]
    assert ready_condition(real, "rank")["status"] == "True"


async def test_hpa_scales_the_rankers_through_the_service_scale_subresource(real: Cluster) -> None:
    await start_service(real, "auto", {"requests": {"cpu": "500m"}},
                        autoscaling={"minReplicas": 1, "maxReplicas": 2, "targetCPUUtilizationPercentage": 50})
    assert real.controllers is not None and real.get("autoscaling/v2/horizontalpodautoscalers", "auto-ranker")
    real.controllers.metrics[("default", "auto-ranker")] = 150  # three times the target: capped at 2
    await real.wait_for("2 rankers", lambda: (real.get(SERVICES, "auto") or {}).get("spec", {}).get("replicas") == 2)
    try:
        await real.wait_for("2 ready rankers", lambda: ready_condition(real, "auto").get("status") == "True"
                            and (real.get(SERVICES, "auto") or {}).get("status", {}).get("readyReplicas") == 2,
                            timeout=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {ready_condition(real, 'auto')}\n{logs(real)}") from None
    assert real.get("v1/pods", "auto-ranker-1") is not None
    assert real.get("apps/v1/statefulsets", "auto-ranker")["spec"]["replicas"] == 2

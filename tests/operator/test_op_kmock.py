"""The kopf operator against KMock with a local kubelet: lifecycle rules end to end, with a fake trainer."""

from __future__ import annotations

from typing import Any

from opsim import Cluster

from grstack.operator import names

JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"


def job(name: str, env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("image", "grstack:test")
    spec.setdefault("progressIntervalSeconds", 1)
    if env:
        spec.setdefault("workers", {})["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def state(c: Cluster, name: str) -> str | None:
    obj = c.get(JOBS, name)
    return ((obj or {}).get("status") or {}).get("state")


async def test_job_succeeds_with_progress(cluster: Cluster) -> None:
    code, _ = await cluster.apply(job("ok", workers={"replicas": 1}))
    assert code in (200, 201)
    await cluster.wait_for("Succeeded", lambda: state(cluster, "ok") == "Succeeded")
    status = cluster.get(JOBS, "ok")["status"]
    assert status["progress"]["step"] == 6
    assert status["progress"]["metrics"] == {"ndcg@10": 0.5}

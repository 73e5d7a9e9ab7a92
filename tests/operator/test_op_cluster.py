"""Opt-in: the operator against a real cluster (``pytest -m cluster``; skipped unless KUBECONFIG is set).

What it needs from the cluster:

- ``KUBECONFIG``: a context allowed to create CRDs, namespaces and the objects in them (the suite applies
  ``crds/``, makes a namespace ``grstack-test-<random>`` and deletes it at the end);
- ``GRSTACK_TEST_IMAGE``: a grstack image the nodes can pull (``docker build --target cpu``); without it the
  training tests are skipped, the API-level ones still run;
- ``GRSTACK_TEST_CLAIM`` (optional): enables the resume test, which creates a PersistentVolumeClaim of this
  name in its namespace (1Gi from the default StorageClass; ReadWriteMany with more than one worker);
- ``GRSTACK_TEST_WORKERS`` (default 1): ranks per job (2 once multi-rank training runs in pods);
- ``GRSTACK_TEST_OPERATOR=installed``: use the operator already running in the cluster (helm install)
  instead of starting ``grstack operator --namespace <ns>`` here with the kubeconfig's identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from grstack.operator import crds, names
from grstack.operator.kube import ApiError, KubeClient

pytestmark = [pytest.mark.e2e, pytest.mark.cluster,
              pytest.mark.skipif(not os.environ.get("KUBECONFIG"), reason="needs KUBECONFIG (a real cluster)")]

IMAGE = os.environ.get("GRSTACK_TEST_IMAGE")
WORKERS = int(os.environ.get("GRSTACK_TEST_WORKERS", "1"))
FAST = {"train.batch_size": 8, "train.num_threads": 1, "train.log_every": 5, "train.epochs": 50,
        "train.eval_every_epochs": 1000, "model.d_model": 16, "model.dqk": 8, "model.dv": 8, "loss.negatives": 16,
        "data.max_len": 16}
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
needs_image = pytest.mark.skipif(not IMAGE, reason="needs GRSTACK_TEST_IMAGE (an image the cluster can pull)")


class Env:
    def __init__(self, client: KubeClient, namespace: str) -> None:
        self.client = client
        self.ns = namespace

    async def get(self, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return await self.client.request("GET", f"/apis/{names.API_VERSION}/namespaces/{self.ns}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["namespace"] = self.ns
        return await self.client.request("POST", f"/apis/{names.API_VERSION}/namespaces/{self.ns}/{plural}", obj)

    async def status(self, name: str, plural: str = names.TRAINING_PLURAL) -> dict[str, Any]:
        return ((await self.get(plural, name)) or {}).get("status") or {}

    async def pods(self, label: str, value: str) -> list[dict[str, Any]]:
        return await self.client.list("v1", "Pod", self.ns, {label: value})

    async def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 300) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await check()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(1)


async def _apply_crds(client: KubeClient) -> None:
    for resource in crds.RESOURCES:
        crd = crds.crd(resource)
        try:
            await client.request("POST", CRD_PATH, crd)
        except ApiError as exc:
            if exc.status != 409:
                raise
            await client.request("PATCH", f"{CRD_PATH}/{crd['metadata']['name']}", {"spec": crd["spec"]},
                                 content_type="application/merge-patch+json")


@contextlib.asynccontextmanager
async def _operator(namespace: str, log: Path) -> AsyncIterator[None]:
    if os.environ.get("GRSTACK_TEST_OPERATOR") == "installed":
        yield
        return
    grstack = Path(sys.executable).with_name("grstack")
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            str(grstack), "operator", "--namespace", namespace, "--liveness-port", "0", "--metrics-port", "0",
            "--resync-seconds", "2", stdout=out, stderr=out, start_new_session=True)
    try:
        yield
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    import kopf

    info = kopf.login_via_client(logger=logging.getLogger("test"), settings=kopf.OperatorSettings())
    client = KubeClient.from_connection(info)
    namespace = f"grstack-test-{uuid.uuid4().hex[:6]}"
    await _apply_crds(client)
    await client.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                        "metadata": {"name": namespace}})
    try:
        async with _operator(namespace, tmp_path / "operator.log"):
            yield Env(client, namespace)
    finally:
        with contextlib.suppress(ApiError):
            await client.request("DELETE", f"/api/v1/namespaces/{namespace}")
        await client.close()


def training_job(name: str, **spec: Any) -> dict[str, Any]:
    spec = {"image": IMAGE or "grstack:absent", "workers": {"replicas": WORKERS}, "maxSteps": 100,
            "overrides": FAST, "progressIntervalSeconds": 2, **spec}
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "metadata": {"name": name}, "spec": spec}


async def _create_when_served(env: Env, plural: str, obj: dict[str, Any]) -> None:
    """Creates the object, retrying while a just-applied CRD is not served yet."""
    for _ in range(60):
        try:
            await env.create(plural, obj)
            return
        except ApiError as exc:
            if exc.status != 404:
                raise
            await asyncio.sleep(1)
    raise AssertionError(f"{plural} is not served")


async def test_api_server_rejects_an_invalid_job(env: Env) -> None:
    await _create_when_served(env, names.TRAINING_PLURAL, training_job("valid-probe"))
    with pytest.raises(ApiError) as caught:
        await env.create(names.TRAINING_PLURAL, training_job("bad", workers={"replicas": 0}))
    assert caught.value.status == 422 and "spec.workers.replicas" in caught.value.message


async def test_operator_rejects_an_invalid_config(env: Env) -> None:
    await _create_when_served(env, names.TRAINING_PLURAL, training_job("badcfg", overrides={"train.epochz": 1}))

    async def failed() -> dict[str, Any] | None:
        return next((c for c in (await env.status("badcfg")).get("conditions", [])
                     if c["type"] == "Failed" and c["reason"] == "InvalidSpec"), None)

    cond = await env.wait_for("InvalidSpec", failed, timeout=120)
    assert "train.epochz" in cond["message"]
    assert await env.pods(names.LABEL_JOB, "badcfg") == []


@needs_image
async def test_trains_to_succeeded_and_deletion_removes_pods(env: Env) -> None:
    await _create_when_served(env, names.TRAINING_PLURAL, training_job("demo"))

    async def done() -> str | None:
        state = (await env.status("demo")).get("state")
        return state if state in ("Succeeded", "Failed") else None

    assert await env.wait_for("the job to finish", done, timeout=900) == "Succeeded"
    progress = (await env.status("demo"))["progress"]
    assert progress["step"] == progress["totalSteps"] == 100 and progress["loss"] > 0
    await env.client.request("DELETE", f"/apis/{names.API_VERSION}/namespaces/{env.ns}/{names.TRAINING_PLURAL}/demo")

    async def pods_gone() -> bool:
        return await env.pods(names.LABEL_JOB, "demo") == []

    await env.wait_for("the garbage collector to remove the pods", pods_gone, timeout=300)


@needs_image
@pytest.mark.skipif(not os.environ.get("GRSTACK_TEST_CLAIM"), reason="needs GRSTACK_TEST_CLAIM (a RWX-capable PVC)")
async def test_deleted_worker_resumes_from_the_checkpoint(env: Env) -> None:
    claim = os.environ["GRSTACK_TEST_CLAIM"]
    await env.client.request("POST", f"/api/v1/namespaces/{env.ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteMany" if WORKERS > 1 else "ReadWriteOnce"],
                 "resources": {"requests": {"storage": "1Gi"}}}})
    await _create_when_served(env, names.TRAINING_PLURAL, training_job(
        "resume", maxSteps=2000, checkpoint={"claimName": claim, "intervalSteps": 100}))

    async def checkpointed() -> bool:
        return bool(((await env.status("resume")).get("progress") or {}).get("lastCheckpoint"))

    await env.wait_for("a checkpoint", checkpointed, timeout=900)
    await env.client.request("DELETE", f"/api/v1/namespaces/{env.ns}/pods/{names.worker_pod_name('resume', 0)}",
                             {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})

    async def done() -> str | None:
        state = (await env.status("resume")).get("state")
        return state if state in ("Succeeded", "Failed") else None

    assert await env.wait_for("the job to finish", done, timeout=900) == "Succeeded"
    status = await env.status("resume")
    assert status["progress"]["step"] == status["progress"]["totalSteps"] == 2000
    assert status["restarts"] == (1 if WORKERS > 1 else 0)  # one worker: its pod is simply recreated


async def test_ranking_service_children_and_scale(env: Env) -> None:
    svc = {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "metadata": {"name": "rank"},
           "spec": {"image": IMAGE or "grstack:absent", "checkpoint": {"path": "/models/model.pt"}}}
    await _create_when_served(env, names.SERVING_PLURAL, svc)

    async def children() -> bool:
        sts = await env.client.get("apps/v1", "StatefulSet", env.ns, "rank-ranker")
        deploy = await env.client.get("apps/v1", "Deployment", env.ns, "rank-router")
        return bool(sts and deploy and sts["metadata"]["ownerReferences"][0]["kind"] == names.SERVING_KIND)

    await env.wait_for("ranker StatefulSet and router Deployment", children, timeout=120)
    assert (await env.status("rank", names.SERVING_PLURAL)).get("url") == f"http://rank.{env.ns}.svc:8080"
    await env.client.request("PATCH", f"/apis/{names.API_VERSION}/namespaces/{env.ns}/{names.SERVING_PLURAL}/rank/scale",
                             {"spec": {"replicas": 2}}, content_type="application/merge-patch+json")

    async def scaled() -> bool:
        sts = await env.client.get("apps/v1", "StatefulSet", env.ns, "rank-ranker")
        return bool(sts and sts["spec"]["replicas"] == 2)

    await env.wait_for("kubectl-scale to reach the StatefulSet", scaled, timeout=120)


async def _patch_job(env: Env, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return await env.client.request(
        "PATCH", f"/apis/{names.API_VERSION}/namespaces/{env.ns}/{names.TRAINING_PLURAL}/{name}", {"spec": spec},
        content_type="application/merge-patch+json")


async def test_replica_change_refused_unless_suspended_and_image_pull_errors_shown(env: Env) -> None:
    """The CRD's CEL rule (a real API server evaluates it), and an unpullable image on the job."""
    await _create_when_served(env, names.TRAINING_PLURAL, training_job(
        "noimage", image="registry.invalid/grstack:absent", workers={"replicas": 2}))
    with pytest.raises(ApiError) as caught:
        await _patch_job(env, "noimage", {"workers": {"replicas": 3}})
    assert caught.value.status == 422 and "suspend" in caught.value.message
    await _patch_job(env, "noimage", {"workers": {"replicas": 3}, "runPolicy": {"suspend": True}})

    async def suspended() -> bool:
        return (await env.status("noimage")).get("state") == "Suspended"

    await env.wait_for("Suspended", suspended, timeout=120)
    await _patch_job(env, "noimage", {"runPolicy": {"suspend": False}})

    async def waiting() -> dict[str, Any] | None:
        return next((c for c in (await env.status("noimage")).get("conditions", [])
                     if c["type"] == "WorkersWaiting" and c["status"] == "True"), None)

    cond = await env.wait_for("WorkersWaiting", waiting, timeout=300)
    assert cond["reason"] in ("ErrImagePull", "ImagePullBackOff", "Unschedulable"), cond
    assert len(await env.pods(names.LABEL_JOB, "noimage")) == 3


@needs_image
@pytest.mark.skipif(not os.environ.get("GRSTACK_TEST_CLAIM"), reason="needs GRSTACK_TEST_CLAIM (a RWX-capable PVC)")
async def test_two_workers_suspended_and_resumed_succeed_with_backoff_limit_0(env: Env) -> None:
    claim = os.environ["GRSTACK_TEST_CLAIM"]
    await env.client.request("POST", f"/api/v1/namespaces/{env.ns}/persistentvolumeclaims", {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    await _create_when_served(env, names.TRAINING_PLURAL, training_job(
        "pause", maxSteps=2000, workers={"replicas": max(2, WORKERS)}, runPolicy={"backoffLimit": 0},
        checkpoint={"claimName": claim, "intervalSteps": 100}))

    async def checkpointed() -> bool:
        return bool(((await env.status("pause")).get("progress") or {}).get("lastCheckpoint"))

    await env.wait_for("a checkpoint", checkpointed, timeout=900)
    await _patch_job(env, "pause", {"runPolicy": {"suspend": True}})

    async def no_pods() -> bool:
        return (await env.status("pause")).get("state") == "Suspended" and not await env.pods(names.LABEL_JOB,
                                                                                               "pause")

    await env.wait_for("suspended without pods", no_pods, timeout=300)
    await _patch_job(env, "pause", {"runPolicy": {"suspend": False}})

    async def done() -> str | None:
        state = (await env.status("pause")).get("state")
        return state if state in ("Succeeded", "Failed") else None

    assert await env.wait_for("the job to finish", done, timeout=900) == "Succeeded"
    assert (await env.status("pause"))["restarts"] == 0

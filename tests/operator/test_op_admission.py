"""What the real ``kubectl`` is told, against the emulated API server (tests/operator/opsim.py, which evaluates
the CRDs' CEL rules and canonicalises built-in kinds' quantities) with ``grstack operator`` running: names the
children could not carry and 100,000 replicas are refused by the API; a pod template asking for the node is
refused by the operator, naming the field; a ranking service written with non-canonical quantities settles
(its StatefulSet is no longer patched) and reaches Ready."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from opsim import Cluster
from test_op_kubectl import Shell, needs_kubectl

from grstack.operator import names

pytestmark = [pytest.mark.e2e, needs_kubectl]

JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"
SERVICES = f"{names.GROUP}/{names.VERSION}/{names.SERVING_PLURAL}"
STATEFULSETS = "apps/v1/statefulsets"
FAKE_TRAINER = [sys.executable, str(Path(__file__).with_name("fake_trainer.py"))]


@pytest.fixture
async def emulated(tmp_path: Path) -> AsyncIterator[tuple[Cluster, Shell]]:
    async with Cluster.start(tmp_path, command_map={"grstack": FAKE_TRAINER}) as c:
        kubeconfig = tmp_path / "kubeconfig"
        c.write_kubeconfig(kubeconfig)
        sh = Shell(kubeconfig)
        await sh.run("kubectl apply -f crds/")
        yield c, sh


def training_job(name: str, **workers: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "metadata": {"name": name},
            "spec": {"image": "grstack:test", "maxSteps": 2, "workers": workers}}


def ranking_service(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "metadata": {"name": name},
            "spec": {"image": "grstack:test", "checkpoint": {"path": "/models/best.pt"}, **spec}}


def condition(c: Cluster, plural: str, name: str, type_: str) -> dict[str, Any]:
    status = (c.get(plural, name) or {}).get("status") or {}
    return next((x for x in status.get("conditions", []) if x["type"] == type_), {})


async def test_names_and_replicas_the_children_cannot_carry_are_refused_by_the_api(
        emulated: tuple[Cluster, Shell]) -> None:
    c, sh = emulated
    for kind, make in ((names.TRAINING_KIND, training_job), (names.SERVING_KIND, ranking_service)):
        for bad in ("demo.v2", "1demo"):
            err = await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(make(bad)), ok=False)
            assert f'"{bad}" is invalid' in err and "metadata.name must be a DNS-1035 label" in err, err
        err = await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(make("x" * 46)), ok=False)
        assert f"metadata.name must be at most {names.MAX_NAME_LENGTH} characters" in err, (kind, err)
    err = await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(training_job("big", replicas=100000)), ok=False)
    assert "spec.workers.replicas" in err and str(names.MAX_REPLICAS) in err, err
    err = await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(ranking_service("big", replicas=100000)), ok=False)
    assert "spec.replicas" in err and str(names.MAX_REPLICAS) in err, err
    await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(ranking_service("big", replicas=3)))
    err = await sh.run("kubectl scale grrs big --replicas=100000", ok=False)
    assert str(names.MAX_REPLICAS) in err, err
    assert c.get(JOBS, "demo.v2") is None and c.get(SERVICES, "1demo") is None and c.get(JOBS, "big") is None


async def test_a_template_asking_for_the_node_is_refused_naming_the_field(emulated: tuple[Cluster, Shell]) -> None:
    c, sh = emulated
    async with c.operator():
        for name, template, field in (
                ("hostnet", {"hostNetwork": True}, "spec.hostNetwork"),
                ("rootfs", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "spec.volumes[root].hostPath"),
                ("sa", {"serviceAccountName": "admin"}, "spec.serviceAccountName"),
                ("priv", {"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]},
                 "spec.containers[trainer].securityContext.privileged")):
            await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(training_job(name, template={"spec": template})))
            await c.wait_for(f"{name} refused", lambda n=name: condition(c, JOBS, n, "Failed").get("reason")
                             == "InvalidSpec")
            message = await sh.run(f"kubectl get grtj {name} -o jsonpath="
                                   "'{.status.conditions[?(@.type==\"Failed\")].message}'")
            assert field in message and "operator.podSecurity.allowPrivileged" in message, message
            assert not c.pods(names.LABEL_JOB, name)


CPU_MEMORY = {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"cpu": "1000m", "memory": "4096Mi"}}


async def test_non_canonical_quantities_settle_and_reach_ready(emulated: tuple[Cluster, Shell]) -> None:
    c, sh = emulated
    c.kubelet.enabled = False  # rankers and routers are not run; their controllers' status is written below
    svc = ranking_service("rank", checkpoint="s3://models/run/model.pt", storage={"sizeLimit": "1.5Gi"},
                          ranker={"resources": CPU_MEMORY}, router={"resources": {"requests": {"cpu": "0.5"}}})
    await sh.run("kubectl apply -f -", stdin=yaml.safe_dump(svc))
    async with c.operator(resync_seconds=0.5):
        # the operator writes the ranker StatefulSet before the router Deployment: wait for both
        await c.wait_for("StatefulSet and Deployment", lambda: c.get(STATEFULSETS, "rank-ranker")
                         and c.get("apps/v1/deployments", "rank-router"))
        pod = c.get(STATEFULSETS, "rank-ranker")["spec"]["template"]["spec"]
        ranker = next(x for x in pod["containers"] if x["name"] == "ranker")
        # stored as kube-apiserver stores them
        assert ranker["resources"] == {"requests": {"cpu": "500m", "memory": "1536Mi"},
                                       "limits": {"cpu": "1", "memory": "4Gi"}}, ranker["resources"]
        assert next(v for v in pod["volumes"] if v["name"] == "model")["emptyDir"]["sizeLimit"] == "1536Mi"
        for path, name, n in ((STATEFULSETS, "rank-ranker", 1), ("apps/v1/deployments", "rank-router", 1)):
            generation = c.get(path, name)["metadata"].get("generation", 1)
            await c.patch(path, name, {"status": {"observedGeneration": generation, "replicas": n,
                                                  "readyReplicas": n, "updatedReplicas": n,
                                                  "availableReplicas": n}}, sub="status")
        await c.wait_for("Ready", lambda: condition(c, SERVICES, "rank", "Ready").get("status") == "True")
        version = c.get(STATEFULSETS, "rank-ranker")["metadata"]["resourceVersion"]
        generation = c.get(STATEFULSETS, "rank-ranker")["metadata"].get("generation")
        await asyncio.sleep(3.0)  # six resync passes
        sts = c.get(STATEFULSETS, "rank-ranker")
        assert (sts["metadata"]["resourceVersion"], sts["metadata"].get("generation")) == (version, generation)
        ready = condition(c, SERVICES, "rank", "Ready")
        assert ready["status"] == "True" and ready["reason"] == "AllReplicasReady", ready
        out = json.loads(await sh.run("kubectl get grrs rank -o json"))
        assert out["status"]["readyReplicas"] == 1

"""``grstack operator`` with Kueue's Workload API: the emulator serves Kueue's published Workload and
ResourceFlavor CRDs (vendored under data/) and validates every write against them; ``FakeKueue`` plays
Kueue's scheduler (admits, evicts, re-admits through the status subresource, as Kueue writes them)."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from conftest import FAKE_TRAINER
from opsim import Cluster
from test_op_kmock import JOBS, condition, create, events, job, status

from grstack.operator import kueue, names

pytestmark = pytest.mark.e2e

DATA = Path(__file__).with_name("data")
WORKLOADS = f"{kueue.API_VERSION}/{kueue.WORKLOAD_PLURAL}"
FLAVOR = {"apiVersion": kueue.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "a100"},
          "spec": {"nodeLabels": {"cloud.example/accelerator": "a100"},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(type_: str, value: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "True" if value else "False", "reason": reason, "message": message,
            "lastTransitionTime": _now(), "observedGeneration": generation}


class FakeKueue:
    """Kueue's scheduler as far as a job controller sees it: admission (SetQuotaReservation +
    SyncAdmittedCondition) and eviction (the Evicted and Preempted conditions), written through the status
    subresource and so validated against Kueue's schema."""

    def __init__(self, c: Cluster) -> None:
        self.c = c

    def workload(self, job_name: str) -> dict[str, Any] | None:
        found = [w for w in self.c.server.live(WORKLOADS)
                 if (w["metadata"].get("labels") or {}).get(names.LABEL_JOB) == job_name]
        assert len(found) <= 1, found
        return found[0] if found else None

    def condition(self, job_name: str, type_: str) -> dict[str, Any]:
        wl = self.workload(job_name) or {}
        return next((x for x in (wl.get("status") or {}).get("conditions") or [] if x["type"] == type_), {})

    async def _write(self, wl: dict[str, Any], status: dict[str, Any]) -> None:
        code, body = await self.c.patch(WORKLOADS, wl["metadata"]["name"], {"status": status}, sub="status")
        assert code == 200, body

    async def admit(self, job_name: str, flavor: str = "a100") -> str:
        """Admits the job's Workload; returns the resourceVersion of that write."""
        wl = self.workload(job_name)
        assert wl is not None
        gen = wl["metadata"]["generation"]
        podset = wl["spec"]["podSets"][0]
        conds = [x for x in (wl.get("status") or {}).get("conditions") or []
                 if x["type"] not in ("QuotaReserved", "Admitted", "Evicted", "Preempted")]
        conds += [_cond("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue cluster-a", gen),
                  _cond("Admitted", True, "Admitted", "The workload is admitted", gen)]
        for gone in ("Evicted", "Preempted"):  # Kueue resets them on a new admission
            if condition_true(wl, gone):
                conds.append(_cond(gone, False, "QuotaReserved", "Previously: preempted", gen))
        await self._write(wl, {"admission": {"clusterQueue": "cluster-a", "podSetAssignments": [
            {"name": podset["name"], "flavors": {"cpu": flavor}, "count": podset["count"],
             "resourceUsage": {"cpu": "2"}}]}, "conditions": conds})
        admitted = self.workload(job_name)
        assert admitted is not None
        return str(admitted["metadata"]["resourceVersion"])

    async def evict(self, job_name: str) -> None:
        wl = self.workload(job_name)
        assert wl is not None
        gen = wl["metadata"]["generation"]
        message = "Preempted to accommodate a workload (UID: 1234) due to prioritization in the ClusterQueue"
        conds = [x for x in wl["status"]["conditions"] if x["type"] not in ("Evicted", "Preempted")]
        conds += [_cond("Evicted", True, "Preempted", message, gen),
                  _cond("Preempted", True, "InClusterQueue", message, gen)]
        await self._write(wl, {**wl["status"], "conditions": conds})


def condition_true(wl: dict[str, Any], type_: str) -> bool:
    return any(x["type"] == type_ and x["status"] == "True" for x in (wl.get("status") or {}).get("conditions") or [])


@pytest.fixture
async def kueue_cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """The emulated cluster with Kueue's CRDs applied through the API (as ``kubectl apply`` would) before the
    operator starts, and one ResourceFlavor."""
    async with Cluster.start(tmp_path, command_map={"grstack": FAKE_TRAINER}) as c:
        for path in sorted(DATA.glob("kueue.x-k8s.io_*.yaml")):
            code, body = await c.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                         yaml.safe_load(path.read_text()))
            assert code in (200, 201), body
        code, body = await c.request("POST", f"/apis/{kueue.API_VERSION}/resourceflavors", FLAVOR)
        assert code in (200, 201), body
        async with c.operator():
            yield c


def queued(name: str, replicas: int = 2, **env: str) -> dict[str, Any]:
    obj = job(name, replicas=replicas, env=env, runPolicy={"backoffLimit": 0})
    obj["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
    obj["spec"]["workers"]["resources"] = {"requests": {"cpu": "1"}}
    return obj


def created_versions(c: Cluster, job_name: str) -> list[int]:
    """The resourceVersion each pod of the job was created with (the emulator's write order)."""
    out = []
    for (res, _, _), obj in list(c.server.objects.items()):
        first = next((v for v in obj.history if v is not None), None)
        if res == kmock.resource("v1/pods") and first is not None \
                and (first.raw["metadata"].get("labels") or {}).get(names.LABEL_JOB) == job_name:
            out.append(int(first.raw["metadata"]["resourceVersion"]))
    return out


async def test_queued_job_runs_only_once_admitted_with_the_flavor_placement(kueue_cluster: Cluster) -> None:
    c, fake = kueue_cluster, FakeKueue(kueue_cluster)
    await create(c, queued("q1", FAKE_STEPS="4"))
    wl = await c.wait_for("the Workload", lambda: fake.workload("q1"))
    assert wl["spec"]["queueName"] == "team-a" and wl["spec"]["podSets"][0]["count"] == 2
    assert wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "1"}}
    job_uid = c.get(JOBS, "q1")["metadata"]["uid"]  # type: ignore[index]
    assert wl["metadata"]["ownerReferences"][0]["uid"] == job_uid
    await c.wait_for("waiting for admission", lambda: condition(c, "q1", "Suspended").get("reason")
                     == "WaitingForAdmission")
    assert status(c, "q1")["state"] == "Suspended" and c.pods(names.LABEL_JOB, "q1") == []

    admitted_at = int(await fake.admit("q1"))
    await c.wait_for("2 pods", lambda: len(c.pods(names.LABEL_JOB, "q1")) == 2)
    assert all(rv > admitted_at for rv in created_versions(c, "q1"))  # no pod before the admission
    for pod in c.pods(names.LABEL_JOB, "q1"):
        assert pod["spec"]["nodeSelector"]["cloud.example/accelerator"] == "a100"
        assert FLAVOR["spec"]["tolerations"][0] in pod["spec"]["tolerations"]  # type: ignore[index]
        assert pod["metadata"]["labels"][kueue.PODSET_LABEL] == "workers"
        assert kueue.QUEUE_LABEL not in pod["metadata"]["labels"]  # Kueue's pod integration leaves them alone
    await c.wait_for("Succeeded", lambda: status(c, "q1").get("state") in ("Succeeded", "Failed"), timeout=90)
    assert status(c, "q1")["state"] == "Succeeded", condition(c, "q1", "Failed")
    await c.wait_for("Workload Finished", lambda: fake.condition("q1", "Finished").get("status") == "True")
    assert fake.condition("q1", "Finished")["reason"] == "Succeeded"
    code, body = await c.delete(JOBS, "q1")
    assert code in (200, 202), body
    await c.wait_for("the Workload deleted with its job", lambda: fake.workload("q1") is None)


async def test_eviction_stops_the_gang_and_readmission_resumes_it(kueue_cluster: Cluster) -> None:
    c, fake = kueue_cluster, FakeKueue(kueue_cluster)
    await create(c, queued("q2", FAKE_STEPS="12", FAKE_STEP_SECONDS="0.2"))
    await c.wait_for("the Workload", lambda: fake.workload("q2"))
    await fake.admit("q2")
    await c.wait_for("a checkpoint", lambda: (status(c, "q2").get("progress") or {}).get("lastCheckpoint"))

    await fake.evict("q2")
    await c.wait_for("pods stopped", lambda: c.pods(names.LABEL_JOB, "q2") == [])
    await c.wait_for("evicted", lambda: condition(c, "q2", "Suspended").get("reason") == "Evicted")
    assert status(c, "q2")["state"] == "Suspended" and "Preempted" in condition(c, "q2", "Suspended")["message"]
    await c.wait_for("admission released", lambda: fake.condition("q2", "QuotaReserved").get("status") == "False")
    wl = fake.workload("q2")
    assert wl is not None and "admission" not in wl["status"]
    assert fake.condition("q2", "Requeued")["status"] == "True"
    assert fake.condition("q2", "Admitted")["status"] == "False"
    assert status(c, "q2")["restarts"] == 0

    await fake.admit("q2")
    await c.wait_for("Succeeded", lambda: status(c, "q2").get("state") in ("Succeeded", "Failed"), timeout=90)
    assert status(c, "q2")["state"] == "Succeeded", condition(c, "q2", "Failed")
    assert status(c, "q2")["restarts"] == 0  # backoffLimit 0: the eviction was not charged
    starts = (c.root / "pvc" / "default" / "ckpt" / "q2" / "starts").read_text().split("\n")
    resumed = [int(line.split()[1]) for line in starts if line.startswith("q2-worker-0 ")]
    assert resumed[0] == 0 and resumed[-1] > 0  # the re-admitted gang resumed from its checkpoint
    assert condition(c, "q2", "Suspended")["status"] == "False"
    await c.wait_for("Workload Finished", lambda: fake.condition("q2", "Finished").get("status") == "True")


async def test_suspend_deactivates_the_workload(kueue_cluster: Cluster) -> None:
    c, fake = kueue_cluster, FakeKueue(kueue_cluster)
    await create(c, queued("q3", FAKE_STEPS="4"))
    await c.wait_for("the Workload", lambda: fake.workload("q3"))
    await c.patch(JOBS, "q3", {"spec": {"runPolicy": {"suspend": True}}})
    await c.wait_for("inactive", lambda: (fake.workload("q3") or {}).get("spec", {}).get("active") is False)
    await c.wait_for("suspended", lambda: condition(c, "q3", "Suspended").get("reason") == "JobSuspended")
    await c.patch(JOBS, "q3", {"spec": {"runPolicy": {"suspend": False}}})
    await c.wait_for("active", lambda: (fake.workload("q3") or {}).get("spec", {}).get("active") is True)
    assert c.pods(names.LABEL_JOB, "q3") == []


async def test_a_job_without_a_queue_runs_as_before(kueue_cluster: Cluster) -> None:
    c = kueue_cluster
    await create(c, job("plain", replicas=2, env={"FAKE_STEPS": "4"}))
    await c.wait_for("Succeeded", lambda: status(c, "plain").get("state") in ("Succeeded", "Failed"), timeout=90)
    assert status(c, "plain")["state"] == "Succeeded", condition(c, "plain", "Failed")
    assert c.server.live(WORKLOADS) == [] and "Suspended" not in c.states(JOBS, "plain")


async def test_a_queued_job_without_kueue_says_so(cluster: Cluster) -> None:
    await create(cluster, queued("nokueue"))
    await cluster.wait_for("held", lambda: condition(cluster, "nokueue", "Suspended").get("reason")
                           == "KueueUnavailable")
    assert "is Kueue installed?" in condition(cluster, "nokueue", "Suspended")["message"]
    assert cluster.pods(names.LABEL_JOB, "nokueue") == []
    await cluster.wait_for("the event", lambda: events(cluster, "nokueue", "KueueUnavailable"))


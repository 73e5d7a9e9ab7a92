"""Refused writes and disruptions, end to end: ``grstack operator`` against the emulator (opsim.py, whose
admission refuses pods as kube-apiserver does: Pod Security ``restricted`` in labelled namespaces,
ResourceQuota, built-in validation).

A refused pod shows on the job (condition ReplicaFailure with the API's message, a Warning Event, backoff in
status), no start time is written for pods that do not exist, and fixing the cause lets the job run; an
evicted worker (DisruptionTarget) restarts the gang without charging backoffLimit while a crash does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from opsim import Cluster
from test_op_kmock import JOBS, SERVICES, job, ranking_service

from grstack.operator import names

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "training-job-multinode.yaml"


async def namespace(c: Cluster, name: str, labels: dict[str, str] | None = None) -> None:
    code, body = await c.request("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels or {}}})
    assert code == 201, body


async def restricted(c: Cluster, name: str = "secure") -> str:
    await namespace(c, name, {"pod-security.kubernetes.io/enforce": "restricted"})
    return name


def in_ns(obj: dict[str, Any], ns: str) -> dict[str, Any]:
    obj["metadata"]["namespace"] = ns
    return obj


def status(c: Cluster, name: str, ns: str) -> dict[str, Any]:
    return (c.get(JOBS, name, ns) or {}).get("status") or {}


def condition(c: Cluster, name: str, ns: str, type_: str) -> dict[str, Any]:
    return next((x for x in status(c, name, ns).get("conditions", []) if x["type"] == type_), {})


def job_events(c: Cluster, name: str, ns: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in c.server.live("v1/events") if e.get("involvedObject", {}).get("name") == name
            and e.get("metadata", {}).get("namespace") == ns and (reason is None or e.get("reason") == reason)]


def pods(c: Cluster, name: str, ns: str) -> list[dict[str, Any]]:
    return [p for p in c.pods(names.LABEL_JOB, name) if p["metadata"]["namespace"] == ns]


async def create(c: Cluster, obj: dict[str, Any]) -> None:
    code, body = await c.apply(obj)
    assert code in (200, 201), body


def refused(c: Cluster, name: str, ns: str) -> bool:
    return condition(c, name, ns, "ReplicaFailure").get("status") == "True"


NFS = {"name": "datasets", "nfs": {"server": "nfs.example", "path": "/datasets"}}


async def test_a_pod_refused_by_pod_security_shows_on_the_job_until_fixed(cluster: Cluster) -> None:
    ns = await restricted(cluster)
    obj = in_ns(job("nfs", replicas=2), ns)
    obj["spec"]["workers"]["template"] = {"spec": {"volumes": [NFS]}}  # allowed by the operator, not here
    await create(cluster, obj)
    await cluster.wait_for("ReplicaFailure", lambda: refused(cluster, "nfs", ns))
    expected = ('pods "nfs-worker-0" is forbidden: violates PodSecurity "restricted:latest": restricted volume '
                'types (volume "datasets" uses restricted volume type "nfs")')
    cond = condition(cluster, "nfs", ns, "ReplicaFailure")
    assert cond["reason"] == "FailedCreate" and expected in cond["message"], cond
    st = status(cluster, "nfs", ns)
    assert st["lastFailure"]["code"] == 403 and st["lastFailure"]["reason"] == "Forbidden"
    assert st["lastFailure"]["message"] == expected and st["lastFailure"]["kind"] == "Pod"
    assert st["retries"] >= 1 and st["nextRetryTime"]
    assert st["state"] == "Created" and "startTime" not in st and "gangStartTime" not in st
    assert pods(cluster, "nfs", ns) == []
    await cluster.wait_for("the Event", lambda: job_events(cluster, "nfs", ns, "FailedCreate"))
    event = job_events(cluster, "nfs", ns, "FailedCreate")[0]
    assert event["type"] == "Warning" and expected in event["message"]
    await cluster.wait_for("a retry", lambda: status(cluster, "nfs", ns).get("retries", 0) >= 2)
    assert "startTime" not in status(cluster, "nfs", ns)

    # The author drops the volume: the next attempt (at once: a new generation) is accepted.
    code, body = await cluster.patch(JOBS, "nfs", {"spec": {"workers": {"template": {"spec": {"volumes": None}}}}},
                                     namespace=ns)
    assert code == 200, body
    await cluster.wait_for("Succeeded", lambda: status(cluster, "nfs", ns).get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    st = status(cluster, "nfs", ns)
    assert st["state"] == "Succeeded", st
    assert condition(cluster, "nfs", ns, "ReplicaFailure")["status"] == "False"
    assert "retries" not in st and "nextRetryTime" not in st and st["lastFailure"]["message"] == expected
    assert st["startTime"] >= st["lastFailure"]["time"]  # written when the pods were created, not before
    await cluster.wait_for("the Events", lambda: {"FailedCreate", "Created", "Succeeded"}
                           <= {e["reason"] for e in job_events(cluster, "nfs", ns)})
    assert len(job_events(cluster, "nfs", ns)) >= 3


async def test_a_pod_over_the_resource_quota_shows_on_the_job_until_the_quota_grows(cluster: Cluster) -> None:
    ns = "team"
    await namespace(cluster, ns)
    await create(cluster, {"apiVersion": "v1", "kind": "ResourceQuota",
                           "metadata": {"name": "compute", "namespace": ns},
                           "spec": {"hard": {"requests.memory": "1Gi"}}})
    obj = in_ns(job("big", replicas=2, env={"FAKE_STEPS": "8", "FAKE_STEP_SECONDS": "0.2"}), ns)
    obj["spec"]["workers"]["resources"] = {"requests": {"memory": "768Mi"}}
    await create(cluster, obj)
    await cluster.wait_for("ReplicaFailure", lambda: refused(cluster, "big", ns))
    expected = ('pods "big-worker-1" is forbidden: exceeded quota: compute, requested: requests.memory=768Mi, '
                'used: requests.memory=768Mi, limited: requests.memory=1Gi')
    assert expected in condition(cluster, "big", ns, "ReplicaFailure")["message"]
    assert status(cluster, "big", ns)["lastFailure"]["code"] == 403
    await cluster.wait_for("the Event", lambda: any(expected in e["message"]
                                                    for e in job_events(cluster, "big", ns, "FailedCreate")))
    assert [p["metadata"]["name"] for p in pods(cluster, "big", ns)] == ["big-worker-0"]
    code, body = await cluster.patch("v1/resourcequotas", "compute", {"spec": {"hard": {"requests.memory": "2Gi"}}},
                                     namespace=ns)
    assert code == 200, body
    await cluster.wait_for("Succeeded", lambda: status(cluster, "big", ns).get("state") in ("Succeeded", "Failed"),
                           timeout=120)
    assert status(cluster, "big", ns)["state"] == "Succeeded"
    assert condition(cluster, "big", ns, "ReplicaFailure")["status"] == "False"


async def test_an_invalid_pod_template_is_refused_with_the_api_message(cluster: Cluster) -> None:
    obj = job("typo", replicas=1)
    obj["spec"]["workers"]["template"] = {"spec": {"containers": [
        {"name": "sidecar", "image": "busybox", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}]}}
    await create(cluster, obj)
    await cluster.wait_for("ReplicaFailure", lambda: refused(cluster, "typo", "default"))
    st = status(cluster, "typo", "default")
    assert st["lastFailure"]["code"] == 422 and st["lastFailure"]["reason"] == "Invalid", st["lastFailure"]
    assert 'Pod "typo-worker-0" is invalid' in st["lastFailure"]["message"]
    assert "volumeMounts[0].name" in st["lastFailure"]["message"]
    assert "startTime" not in st and st["state"] == "Created"
    await cluster.wait_for("the Event", lambda: job_events(cluster, "typo", "default", "FailedCreate"))


async def test_the_multinode_example_runs_in_a_restricted_namespace(cluster: Cluster) -> None:
    ns = await restricted(cluster, "ml")
    obj = in_ns(yaml.safe_load(EXAMPLE.read_text()), ns)
    obj["spec"]["workers"]["env"].append({"name": "FAKE_STEPS", "value": "4"})
    await create(cluster, obj)
    name = obj["metadata"]["name"]
    await cluster.wait_for("Suspended", lambda: status(cluster, name, ns).get("state") == "Suspended")
    code, body = await cluster.patch(JOBS, name, {"spec": {"runPolicy": {"suspend": False}}}, namespace=ns)
    assert code == 200, body
    await cluster.wait_for("Succeeded", lambda: status(cluster, name, ns).get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    assert status(cluster, name, ns)["state"] == "Succeeded", status(cluster, name, ns)
    assert not job_events(cluster, name, ns, "FailedCreate")
    assert condition(cluster, name, ns, "ReplicaFailure") == {}
    shipper = next(c for c in pods(cluster, name, ns)[0]["spec"]["containers"] if c["name"] == "log-shipper")
    assert shipper["securityContext"]["allowPrivilegeEscalation"] is False
    await cluster.wait_for("the Events", lambda: {"Suspended", "Resumed", "Succeeded"}
                           <= {e["reason"] for e in job_events(cluster, name, ns)})


async def test_an_eviction_restarts_the_gang_without_charging_backoff_limit(cluster: Cluster) -> None:
    await create(cluster, job("drain", replicas=2, env={"FAKE_STEPS": "40", "FAKE_STEP_SECONDS": "0.25"},
                              runPolicy={"backoffLimit": 0}))
    await cluster.wait_for("running", lambda: status(cluster, "drain", "default").get("gangAttempt") == 0
                           and status(cluster, "drain", "default").get("state") == "Running")
    # What the eviction API (kubectl drain) writes before the pod is deleted.
    code, body = await cluster.patch("v1/pods", "drain-worker-1", {"status": {"conditions": [
        {"type": "Ready", "status": "True"},
        {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
         "message": "Eviction API: evicting"}]}}, sub="status")
    assert code == 200, body
    await cluster.wait_for("the new gang", lambda: status(cluster, "drain", "default").get("gangAttempt") == 1
                           and status(cluster, "drain", "default").get("state") == "Running", timeout=90)
    st = status(cluster, "drain", "default")
    assert st["restarts"] == 0 and st["disruptions"] == 1
    assert "Restarting" in cluster.states(JOBS, "drain")
    assert any("drain-worker-1 was disrupted (EvictionByEvictionAPI" in e["message"]
               for e in job_events(cluster, "drain", "default", "Restarting"))
    # A crash of the new gang is a genuine failure: charged, and backoffLimit 0 is used up.
    cluster.kubelet.kill("drain-worker-1")
    await cluster.wait_for("Failed", lambda: status(cluster, "drain", "default").get("state") == "Failed",
                           timeout=90)
    assert condition(cluster, "drain", "default", "Failed")["reason"] == "BackoffLimitExceeded"
    assert status(cluster, "drain", "default")["disruptions"] == 1
    await cluster.wait_for("two Events", lambda: len(job_events(cluster, "drain", "default")) >= 2)


async def test_a_ranking_service_child_over_an_object_quota_shows_on_the_service(cluster: Cluster) -> None:
    ns = "serving"
    await namespace(cluster, ns)
    await create(cluster, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "objects", "namespace": ns},
                           "spec": {"hard": {"count/deployments.apps": "0"}}})
    await create(cluster, in_ns(ranking_service("rank"), ns))

    def svc_condition() -> dict[str, Any]:
        st = (cluster.get(SERVICES, "rank", ns) or {}).get("status") or {}
        return next((x for x in st.get("conditions", []) if x["type"] == "ReplicaFailure"), {})

    await cluster.wait_for("ReplicaFailure", lambda: svc_condition().get("status") == "True")
    expected = ('deployments.apps "rank-router" is forbidden: exceeded quota: objects, requested: '
                'count/deployments.apps=1, used: count/deployments.apps=0, limited: count/deployments.apps=0')
    assert svc_condition()["reason"] == "FailedCreate" and expected in svc_condition()["message"]
    st = cluster.get(SERVICES, "rank", ns)["status"]
    assert st["lastFailure"]["kind"] == "Deployment" and st["retries"] >= 1
    await cluster.wait_for("the Event", lambda: any(expected in e["message"]
                                                    for e in job_events(cluster, "rank", ns, "FailedCreate")))
    code, body = await cluster.patch("v1/resourcequotas", "objects",
                                     {"spec": {"hard": {"count/deployments.apps": "1"}}}, namespace=ns)
    assert code == 200, body
    await cluster.wait_for("the router", lambda: cluster.get("apps/v1/deployments", "rank-router", ns), timeout=120)
    await cluster.wait_for("recovered", lambda: svc_condition().get("status") == "False", timeout=60)

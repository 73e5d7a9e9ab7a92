"""``grstack operator`` against the emulator (KMock + local kubelet): issue #13's lifecycle fixes with 2 workers.

A 2-worker job suspended and resumed with ``backoffLimit: 0`` must still succeed (the resumed gang is no lost
worker), and a spec change of a running gang restarts it on purpose (``SpecChanged``), not as a failure.
"""

from __future__ import annotations

import pytest
from opsim import Cluster
from test_op_kmock import JOBS, condition, create, events, job, status

from grstack.operator import names

pytestmark = pytest.mark.e2e


def _env(c: Cluster, name: str) -> list[dict[str, str]]:
    return [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
            for p in c.pods(names.LABEL_JOB, name)]


async def test_two_worker_suspend_and_resume_with_backoff_limit_0(cluster: Cluster) -> None:
    await create(cluster, job("pause2", replicas=2, env={"FAKE_STEPS": "12", "FAKE_STEP_SECONDS": "0.2"},
                              runPolicy={"backoffLimit": 0}))
    await cluster.wait_for("Running", lambda: status(cluster, "pause2").get("state") == "Running")
    await cluster.wait_for("a checkpoint", lambda: (status(cluster, "pause2").get("progress") or {})
                           .get("lastCheckpoint"))
    await cluster.patch(JOBS, "pause2", {"spec": {"runPolicy": {"suspend": True}}})
    await cluster.wait_for("Suspended", lambda: status(cluster, "pause2").get("state") == "Suspended")
    await cluster.wait_for("no pods", lambda: cluster.pods(names.LABEL_JOB, "pause2") == [])
    await cluster.patch(JOBS, "pause2", {"spec": {"runPolicy": {"suspend": False}}})
    await cluster.wait_for("Succeeded", lambda: status(cluster, "pause2").get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    assert status(cluster, "pause2")["state"] == "Succeeded", condition(cluster, "pause2", "Failed")
    assert status(cluster, "pause2")["restarts"] == 0
    assert condition(cluster, "pause2", "Suspended")["reason"] == "JobResumed"


async def test_env_change_restarts_a_running_gang_on_purpose(cluster: Cluster) -> None:
    await create(cluster, job("change", replicas=2, env={"FAKE_STEPS": "14", "FAKE_STEP_SECONDS": "0.2"},
                              runPolicy={"backoffLimit": 0}))
    await cluster.wait_for("Running", lambda: status(cluster, "change").get("state") == "Running")
    await cluster.patch(JOBS, "change", {"spec": {"workers": {"env": [
        {"name": "FAKE_STEPS", "value": "14"}, {"name": "FAKE_STEP_SECONDS", "value": "0.2"},
        {"name": "EXTRA", "value": "1"}]}}})
    await cluster.wait_for("SpecChanged", lambda: events(cluster, "change", "SpecChanged"))
    await cluster.wait_for("new gang", lambda: len(_env(cluster, "change")) == 2
                           and all(e.get("EXTRA") == "1" for e in _env(cluster, "change")))
    await cluster.wait_for("Succeeded", lambda: status(cluster, "change").get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    assert status(cluster, "change")["state"] == "Succeeded", condition(cluster, "change", "Failed")
    assert status(cluster, "change")["restarts"] == 0
    assert "container env" in events(cluster, "change", "SpecChanged")[0]


async def test_replica_change_while_suspended_takes_effect_on_resume(cluster: Cluster) -> None:
    await create(cluster, job("grow", replicas=2, env={"FAKE_STEPS": "12", "FAKE_STEP_SECONDS": "0.2"},
                              runPolicy={"backoffLimit": 0}))
    await cluster.wait_for("Running", lambda: status(cluster, "grow").get("state") == "Running")
    await cluster.patch(JOBS, "grow", {"spec": {"runPolicy": {"suspend": True}, "workers": {"replicas": 3}}})
    await cluster.wait_for("Suspended", lambda: status(cluster, "grow").get("state") == "Suspended")
    await cluster.wait_for("no pods", lambda: cluster.pods(names.LABEL_JOB, "grow") == [])
    await cluster.patch(JOBS, "grow", {"spec": {"runPolicy": {"suspend": False}}})
    await cluster.wait_for("3 workers", lambda: len(_env(cluster, "grow")) == 3)
    assert {e["WORLD_SIZE"] for e in _env(cluster, "grow")} == {"3"}
    await cluster.wait_for("Succeeded", lambda: status(cluster, "grow").get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    assert status(cluster, "grow")["state"] == "Succeeded", condition(cluster, "grow", "Failed")


async def test_gang_scheduled_job_created_suspended_then_admitted(cluster: Cluster) -> None:
    """Created suspended (admitted by hand), no pods until unsuspended; the PodGroup (whose CRD the emulator
    may lack) does not block the job. (Kueue admits through a Workload instead: test_op_kueue_kmock.py.)"""
    obj = job("queued", replicas=2, env={"FAKE_STEPS": "4"},
              runPolicy={"suspend": True, "schedulingPolicy": {"gangScheduler": "Coscheduling"}})
    await create(cluster, obj)
    await cluster.wait_for("Suspended", lambda: status(cluster, "queued").get("state") == "Suspended")
    assert cluster.pods(names.LABEL_JOB, "queued") == []
    await cluster.patch(JOBS, "queued", {"spec": {"runPolicy": {"suspend": False}}})
    await cluster.wait_for("2 pods", lambda: len(cluster.pods(names.LABEL_JOB, "queued")) == 2)
    for p in cluster.pods(names.LABEL_JOB, "queued"):
        assert p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "queued"
    await cluster.wait_for("Succeeded", lambda: status(cluster, "queued").get("state") in ("Succeeded", "Failed"),
                           timeout=90)
    assert status(cluster, "queued")["state"] == "Succeeded", condition(cluster, "queued", "Failed")


async def test_image_pull_backoff_surfaces_as_condition_and_event(cluster: Cluster) -> None:
    """A worker whose container waits in ImagePullBackOff (reported by the kubelet) shows on the job."""
    obj = job("pull", replicas=2, env={"FAKE_STEPS": "4"})
    # a ConfigMap that does not exist keeps the emulator's kubelet in ContainerCreating, so the test can play
    # the kubelet that cannot pull the image
    obj["spec"]["workers"]["template"] = {"spec": {
        "volumes": [{"name": "extra", "configMap": {"name": "missing"}}],
        "containers": [{"name": "trainer", "volumeMounts": [{"name": "extra", "mountPath": "/extra"}]}]}}
    await create(cluster, obj)
    await cluster.wait_for("2 pods", lambda: len(cluster.pods(names.LABEL_JOB, "pull")) == 2)
    message = 'Back-off pulling image "grstack:typo"'
    code, body = await cluster.patch("v1/pods", "pull-worker-1", {"status": {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 0, "image": "grstack:typo", "imageID": "",
         "state": {"waiting": {"reason": "ImagePullBackOff", "message": message}}}]}}, sub="status")
    assert code == 200, body
    await cluster.wait_for("WorkersWaiting", lambda: condition(cluster, "pull", "WorkersWaiting").get("reason")
                           == "ImagePullBackOff")
    cond = condition(cluster, "pull", "WorkersWaiting")
    assert cond["status"] == "True" and "pull-worker-1" in cond["message"] and message in cond["message"]
    await cluster.wait_for("Event", lambda: events(cluster, "pull", "ImagePullBackOff"))
    assert status(cluster, "pull")["state"] == "Created"

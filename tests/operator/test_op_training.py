"""Table-driven tests of the pure GRTrainingJob reconcile: (job, observed pods, now) -> plan."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from grstack.operator import names
from grstack.operator.models import GRTrainingJobStatus
from grstack.operator.training import reconcile_training

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
T0 = "2026-01-01T11:00:00Z"  # an hour before NOW


def job(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, name: str = "demo") -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": {"image": "grstack:cpu", "workers": {"replicas": 2}, **(spec or {})},
            "status": status or {}}


def started(state: str = "Running", restarts: int = 0, **extra: Any) -> dict[str, Any]:
    return {"state": state, "restarts": restarts, "startTime": T0,
            "conditions": [{"type": "Created", "status": "True", "reason": "JobCreated", "message": "",
                            "lastTransitionTime": T0}], **extra}


def pod(rank: int, phase: str = "Running", attempt: int = 0, exit_code: int | None = None,
        progress: dict[str, Any] | None = None, terminating: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"demo-worker-{rank}", "namespace": "ns",
                            "labels": {names.LABEL_JOB: "demo", names.LABEL_RANK: str(rank),
                                       names.LABEL_ATTEMPT: str(attempt)}}
    if progress is not None:
        meta["annotations"] = {names.ANNOTATION_PROGRESS: json.dumps(progress)}
    if terminating:
        meta["deletionTimestamp"] = T0
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {
            "exitCode": exit_code, "reason": "Error", "message": "Traceback ...\nRuntimeError: boom"}}}]
    return {"metadata": meta, "status": status}


@dataclass
class Case:
    name: str
    job: dict[str, Any]
    pods: list[dict[str, Any]]
    state: str | None
    create: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    restarts: int = 0
    reason: str | None = None  # reason of the condition for `state`
    delete_job: bool = False
    event: str | None = None


CASES = [
    Case("new job creates one pod per rank", job(), [], "Created", create=["demo-worker-0", "demo-worker-1"]),
    Case("some pods pending: still Created", job(status=started("Created")), [pod(0), pod(1, "Pending")],
         "Created"),
    Case("all pods running -> Running", job(status=started("Created")), [pod(0), pod(1)], "Running",
         reason="JobRunning"),
    Case("a rank not yet created is created", job(status=started("Created")), [pod(0, "Pending")], "Created",
         create=["demo-worker-1"]),
    Case("a rank lost after the gang was complete restarts it", job(status=started(gangAttempt=0)), [pod(0)],
         "Restarting",
         delete=["demo-worker-0"], restarts=1, reason="WorkerLost", event="Restarting"),
    Case("a single worker that vanished is recreated", job({"workers": {"replicas": 1}}, started()), [], "Running",
         create=["demo-worker-0"]),
    Case("rank 0 succeeded -> Succeeded, pods kept (cleanPodPolicy None)", job(status=started()),
         [pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)], "Succeeded", reason="JobSucceeded",
         event="Succeeded"),
    Case("cleanPodPolicy Running deletes only still-running pods",
         job({"runPolicy": {"cleanPodPolicy": "Running"}}, started()),
         [pod(0, "Succeeded", exit_code=0), pod(1)], "Succeeded", delete=["demo-worker-1"]),
    Case("cleanPodPolicy All deletes every pod", job({"runPolicy": {"cleanPodPolicy": "All"}}, started()),
         [pod(0, "Succeeded", exit_code=0), pod(1, "Succeeded", exit_code=0)], "Succeeded",
         delete=["demo-worker-0", "demo-worker-1"]),
    Case("a failed worker restarts the whole gang", job(status=started()), [pod(0), pod(1, "Failed", exit_code=137)],
         "Restarting", delete=["demo-worker-0", "demo-worker-1"], restarts=1, reason="WorkerFailed",
         event="Restarting"),
    Case("next attempt is created once the old pods are gone", job(status=started("Restarting", restarts=1)), [],
         "Restarting", create=["demo-worker-0", "demo-worker-1"], restarts=1),
    Case("next attempt waits while an old pod holds a name", job(status=started("Restarting", restarts=1)),
         [pod(0, "Running", attempt=0, terminating=True)], "Restarting", restarts=1),
    Case("old-attempt pods still alive are deleted", job(status=started("Restarting", restarts=1)),
         [pod(0, "Running", attempt=0)], "Restarting", delete=["demo-worker-0"], restarts=1),
    Case("new attempt running -> Running again", job(status=started("Restarting", restarts=1)),
         [pod(0, attempt=1), pod(1, attempt=1)], "Running", restarts=1, reason="JobRunning"),
    Case("backoffLimit reached -> Failed, survivors deleted",
         job({"runPolicy": {"backoffLimit": 1}}, started(restarts=1)),
         [pod(0, attempt=1), pod(1, "Failed", attempt=1, exit_code=1)], "Failed", delete=["demo-worker-0"],
         restarts=1, reason="BackoffLimitExceeded", event="BackoffLimitExceeded"),
    Case("backoffLimit 0 -> the first failure is final", job({"runPolicy": {"backoffLimit": 0}}, started()),
         [pod(0, "Failed", exit_code=1), pod(1)], "Failed", delete=["demo-worker-1"], reason="BackoffLimitExceeded"),
    Case("exit status 2 (user error) is not retried", job(status=started()), [pod(0, "Failed", exit_code=2), pod(1)],
         "Failed", delete=["demo-worker-1"], reason="UserError"),
    Case("activeDeadlineSeconds exceeded -> Failed", job({"runPolicy": {"activeDeadlineSeconds": 60}}, started()),
         [pod(0), pod(1)], "Failed", delete=["demo-worker-0", "demo-worker-1"], reason="DeadlineExceeded"),
    Case("suspend deletes the pods", job({"runPolicy": {"suspend": True}}, started()), [pod(0), pod(1)],
         "Suspended", delete=["demo-worker-0", "demo-worker-1"], reason="JobSuspended", event="Suspended"),
    Case("resume recreates the pods", job(status=started("Suspended")), [], "Created",
         create=["demo-worker-0", "demo-worker-1"], event="Resumed"),
    Case("ttlSecondsAfterFinished passed -> delete the job",
         job({"runPolicy": {"ttlSecondsAfterFinished": 60}}, started("Succeeded", completionTime=T0)), [],
         "Succeeded", delete_job=True),
    Case("ttlSecondsAfterFinished pending -> keep", job({"runPolicy": {"ttlSecondsAfterFinished": 7200}},
                                                       started("Succeeded", completionTime=T0)), [], "Succeeded"),
    Case("finished jobs create nothing", job(status=started("Failed", completionTime=T0)), [pod(1, "Failed")],
         "Failed"),
    Case("invalid spec -> Failed InvalidSpec", job({"workers": {"replicas": 0}}), [], "Failed", reason="InvalidSpec",
         event="InvalidSpec"),
    Case("a trainer config key that does not exist -> InvalidSpec", job({"overrides": {"train.epochz": 3}}), [],
         "Failed", reason="InvalidSpec"),
    Case("a name too long for pod names -> InvalidSpec", job(name="x" * 60), [], "Failed", reason="InvalidSpec"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lifecycle(case: Case) -> None:
    plan = reconcile_training(case.job, case.pods, NOW)
    assert plan.status.get("state") == case.state
    assert sorted(p["metadata"]["name"] for p in plan.create_pods) == sorted(case.create)
    assert sorted(plan.delete_pods) == sorted(case.delete)
    assert plan.status["restarts"] == case.restarts
    assert plan.delete_job == case.delete_job
    if case.reason:
        cond = next(c for c in plan.status["conditions"] if c["type"] == case.state)
        assert (cond["status"], cond["reason"]) == ("True", case.reason)
    if case.event:
        assert case.event in [reason for _, reason, _ in plan.events]
    GRTrainingJobStatus.model_validate(plan.status)  # the status fits the CRD's status schema
    assert reconcile_training(case.job, case.pods, NOW) == plan  # pure: same input, same plan


def test_messages_name_the_problem() -> None:
    failed = reconcile_training(job(status=started()), [pod(0), pod(1, "Failed", exit_code=137)], NOW)
    restarting = next(c for c in failed.status["conditions"] if c["type"] == "Restarting")
    assert "demo-worker-1" in restarting["message"] and "137" in restarting["message"]
    assert "RuntimeError: boom" in restarting["message"]
    invalid = reconcile_training(job({"overrides": {"train.epochz": 3}}), [], NOW)
    assert "train.epochz" in next(c for c in invalid.status["conditions"] if c["type"] == "Failed")["message"]
    replicas = reconcile_training(job({"workers": {"replicas": 0}}), [], NOW)
    assert "spec.workers.replicas" in next(c for c in replicas.status["conditions"] if c["type"] == "Failed")["message"]


def test_previous_state_conditions_flip_to_false() -> None:
    running = reconcile_training(job(status=started("Created")), [pod(0), pod(1)], NOW).status
    restarting = reconcile_training(job(status=running), [pod(0), pod(1, "Failed", exit_code=1)], NOW).status
    by_type = {c["type"]: c for c in restarting["conditions"]}
    assert by_type["Running"]["status"] == "False" and by_type["Restarting"]["status"] == "True"
    assert by_type["Created"]["status"] == "True"


def test_transition_time_changes_only_when_status_flips() -> None:
    first = reconcile_training(job(status=started("Created")), [pod(0), pod(1)], NOW).status
    later = NOW + dt.timedelta(minutes=5)
    second = reconcile_training(job(status=first), [pod(0), pod(1)], later).status
    assert second["conditions"] == first["conditions"]


def test_progress_from_rank0_annotation() -> None:
    report = {"step": 30, "total_steps": 120, "epoch": 1, "loss": 2.5, "samples_per_second": 800.0,
              "tokens_per_second": 9000.0, "last_checkpoint": "/run/checkpoints/step-30", "time": T0}
    status = reconcile_training(job(status=started()), [pod(0, progress=report), pod(1)], NOW).status
    assert status["progress"] == {"step": 30, "totalSteps": 120, "epoch": 1, "loss": 2.5, "samplesPerSecond": 800.0,
                                  "tokensPerSecond": 9000.0, "lastCheckpoint": "/run/checkpoints/step-30",
                                  "updateTime": T0, "summary": "25% (30/120)"}
    # A restarted gang's new rank 0 has reported nothing yet: the last known progress stays.
    after = reconcile_training(job(status={**status, "restarts": 1}), [pod(0, attempt=1)], NOW).status
    assert after["progress"] == status["progress"]
    garbage = reconcile_training(job(status=status), [pod(0, progress=None) | {"metadata": {
        **pod(0)["metadata"], "annotations": {names.ANNOTATION_PROGRESS: "{not json"}}}], NOW).status
    assert garbage["progress"] == status["progress"]


def _created(spec: dict[str, Any]) -> dict[str, Any]:
    plan = reconcile_training(job(spec), [], NOW)
    return {p["metadata"]["name"]: p for p in plan.create_pods}


def test_pods_carry_torchrun_env_and_rank0_reporting() -> None:
    pods = _created({"workers": {"replicas": 3}})
    for rank in range(3):
        spec = pods[f"demo-worker-{rank}"]["spec"]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["MASTER_ADDR"] == "demo-worker-0.demo-workers"
        assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("3", str(rank), "0")
        assert ("GRSTACK_PROGRESS_ANNOTATION" in env) == (rank == 0)
        assert spec["automountServiceAccountToken"] == (rank == 0)
        assert spec["subdomain"] == "demo-workers" and spec["hostname"] == f"demo-worker-{rank}"
        assert spec["restartPolicy"] == "Never"


@pytest.mark.parametrize(("accelerator", "resource"), [("nvidia", "nvidia.com/gpu"),
                                                      ("ascend", "huawei.com/Ascend910"), ("cpu", None)])
def test_accelerator_resources(accelerator: str, resource: str | None) -> None:
    pods = _created({"workers": {"replicas": 1, "accelerator": accelerator,
                                 "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}})
    res = pods["demo-worker-0"]["spec"]["containers"][0]["resources"]
    assert res["requests"]["cpu"] == "2"
    if resource:
        assert res["limits"][resource] == 1 and res["requests"][resource] == 1
    else:
        assert "limits" not in res


def test_pod_security_volumes_and_scheduling() -> None:
    pods = _created({"workers": {"replicas": 1}, "checkpoint": {"claimName": "ckpt", "intervalSteps": 50},
                     "data": {"claimName": "datasets", "format": "parquet", "source": "/data/kuairand"},
                     "maxSteps": 500, "overrides": {"optim.lr": 0.01},
                     "scheduling": {"schedulerName": "volcano", "priorityClassName": "high",
                                    "nodeSelector": {"pool": "gpu"},
                                    "tolerations": [{"key": "gpu", "operator": "Exists"}]}})
    spec = pods["demo-worker-0"]["spec"]
    container = spec["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["checkpoint"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    assert volumes["config"]["configMap"]["name"] == "demo-config"
    args = container["args"]
    assert args[:2] == ["train", "--config"] and "/var/grstack/run/demo" in args
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert sets == ["train.max_steps=500", "train.checkpoint_every=50", "data.format=parquet",
                    "data.source=/data/kuairand", "optim.lr=0.01"]
    assert (spec["schedulerName"], spec["priorityClassName"]) == ("volcano", "high")
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"][0]["key"] == "gpu"


def test_children_own_config_service_and_least_privilege_role() -> None:
    plan = reconcile_training(job(), [], NOW)
    kinds = {c["kind"]: c for c in plan.children}
    assert set(kinds) == {"ConfigMap", "Service", "ServiceAccount", "Role", "RoleBinding"}
    assert "hstu" in kinds["ConfigMap"]["data"]["config.yaml"]  # the built-in demo config
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    assert kinds["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                       "resourceNames": ["demo-worker-0"], "verbs": ["get", "patch"]}]
    for obj in plan.children + plan.create_pods:
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("GRTrainingJob", "uid-1", True)


def test_inline_config_is_used() -> None:
    config = "name: custom\ndata: {format: synth, source: tiny}\ntrain: {epochs: 1}\n"
    plan = reconcile_training(job({"config": config}), [], NOW)
    assert next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["config.yaml"] == config
    bad = reconcile_training(job({"config": "train: [1, 2"}), [], NOW)
    assert bad.status["state"] == "Failed" and "YAML" in json.dumps(bad.status["conditions"])

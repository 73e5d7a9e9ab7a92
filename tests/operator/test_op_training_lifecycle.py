"""Issue #13 item 1: suspend/resume of a multi-worker gang, and spec changes of a running job, per field."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import pytest
from training_jobs import NOW, T0, job

from grstack.operator import crds, training
from grstack.operator.training import reconcile_training

pytestmark = pytest.mark.unit


def as_live(pods: list[dict[str, Any]], phase: str = "Running") -> list[dict[str, Any]]:
    out = copy.deepcopy(pods)
    for p in out:
        p["status"] = {"phase": phase}
    return out


def run_gang(spec: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job whose gang was created and seen Running: (status, live pods)."""
    plan = reconcile_training(job(spec), [], NOW)
    pods = as_live(plan.create_pods)
    plan = reconcile_training(job(spec, plan.status), pods, NOW)
    assert plan.status["state"] == "Running" and plan.status["gangAttempt"] == 0
    return plan.status, pods


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("backoff", [0, 3])
def test_suspend_and_resume_a_multi_worker_gang(replicas: int, backoff: int) -> None:
    spec = {"workers": {"replicas": replicas}, "runPolicy": {"backoffLimit": backoff}}
    status, pods = run_gang(spec)
    suspended = {**spec, "runPolicy": {"backoffLimit": backoff, "suspend": True}}
    plan = reconcile_training(job(suspended, status, 2), pods, NOW)
    assert plan.status["state"] == "Suspended" and "gangAttempt" not in plan.status
    assert sorted(plan.delete_pods) == sorted(p["metadata"]["name"] for p in pods)
    plan = reconcile_training(job(suspended, plan.status, 2), [], NOW)  # pods gone
    assert plan.status["state"] == "Suspended"
    # resume: the empty gang is recreated, not read as a lost worker
    plan = reconcile_training(job(spec, plan.status, 3), [], NOW)
    assert plan.status["state"] == "Created" and plan.status["restarts"] == 0
    assert len(plan.create_pods) == replicas and not plan.delete_pods
    assert [e[1] for e in plan.events] == ["Resumed"]
    # the resumed gang runs; its restarts budget is untouched
    pods = as_live(plan.create_pods)
    plan = reconcile_training(job(spec, plan.status, 3), pods, NOW)
    assert plan.status["state"] == "Running" and plan.status["restarts"] == 0 and plan.status["gangAttempt"] == 0


def test_resume_while_old_pods_terminate_waits() -> None:
    status, pods = run_gang()
    plan = reconcile_training(job({"runPolicy": {"suspend": True}}, status), pods, NOW)
    dying = copy.deepcopy(pods)
    for p in dying:
        p["metadata"]["deletionTimestamp"] = T0
    plan = reconcile_training(job(status=plan.status), dying, NOW)
    assert plan.status["state"] == "Created" and not plan.create_pods and plan.requeue_after == 1.0
    plan = reconcile_training(job(status=plan.status), [], NOW)
    assert len(plan.create_pods) == 2 and plan.status["restarts"] == 0


def _change(field: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = copy.deepcopy(base or {})
    node = spec
    *path, last = field.split(".")
    for key in path:
        node = node.setdefault(key, {})
    node[last] = value
    return spec


# Fields that reach the pods: a running gang restarts on purpose, without charging backoffLimit.
RESTARTING = [
    ("image", "grstack:cpu-2"),
    ("imagePullPolicy", "Always"),
    ("imagePullSecrets", ["regcred"]),
    ("config", "name: custom\ndata: {format: synth, source: tiny}\ntrain: {epochs: 1}\n"),
    ("overrides", {"optim.lr": 0.01}),
    ("maxSteps", 100),
    ("workers.env", [{"name": "FOO", "value": "1"}]),
    ("workers.resources", {"requests": {"cpu": "2"}}),
    ("workers.accelerator", "nvidia"),
    ("data.claimName", "datasets"),
    ("checkpoint.claimName", "ckpt"),
    ("checkpoint.intervalSteps", 50),
    ("scheduling.nodeSelector", {"pool": "gpu"}),
    ("progressIntervalSeconds", 30),
    ("workers.envFrom", [{"secretRef": {"name": "creds"}}]),
    ("workers.template", {"metadata": {"annotations": {"team": "a"}}}),
    ("workers.template", {"spec": {"priorityClassName": "high"}}),
    ("workers.nprocPerNode", 2),  # only when the CEL rule let it through (suspended in between)
    ("runPolicy.schedulingPolicy", {"gangScheduler": "Volcano"}),
    ("workers.replicas", 3),  # only when the CEL rule let it through (suspended in between)
    ("workers.replicas", 1),
]


@pytest.mark.parametrize(("field", "value"), RESTARTING, ids=[f"{f}={v}" for f, v in RESTARTING])
def test_a_spec_change_restarts_the_gang_on_purpose(field: str, value: Any) -> None:
    status, pods = run_gang()
    spec = _change(field, value, {"workers": {"replicas": 2}})
    plan = reconcile_training(job(spec, status, 2), pods, NOW)
    assert plan.status["state"] == "Restarting", plan.status
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Restarting")
    assert cond["reason"] == "SpecChanged" and "generation 2" in cond["message"]
    assert sorted(plan.delete_pods) == ["demo-worker-0", "demo-worker-1"] and not plan.create_pods
    assert plan.status["restarts"] == 0 and "gangAttempt" not in plan.status
    assert [e[1] for e in plan.events] == ["SpecChanged"]
    # next pass: the old pods are terminating, then gone: one gang of the new spec, no WorkerLost
    dying = copy.deepcopy(pods)
    for p in dying:
        p["metadata"]["deletionTimestamp"] = T0
    plan = reconcile_training(job(spec, plan.status, 2), dying, NOW)
    assert plan.status["state"] == "Restarting" and not plan.create_pods
    plan = reconcile_training(job(spec, plan.status, 2), [], NOW)
    workers = _change(field, value, {"workers": {"replicas": 2}})["workers"]
    replicas = workers["replicas"]
    assert len(plan.create_pods) == replicas and plan.status["restarts"] == 0
    new = as_live(plan.create_pods)
    env = {e["name"]: e.get("value") for e in new[0]["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == str(replicas * workers.get("nprocPerNode", 1))
    plan = reconcile_training(job(spec, plan.status, 2), new, NOW)
    assert plan.status["state"] == "Running" and not plan.delete_pods and not plan.create_pods


def test_spec_change_message_names_the_field() -> None:
    status, pods = run_gang()
    plan = reconcile_training(job({"image": "grstack:new"}, status, 2), pods, NOW)
    assert "container image" in plan.status["conditions"][-1]["message"] or any(
        "container image" in c["message"] for c in plan.status["conditions"])


# runPolicy fields apply in place: no restart.
IN_PLACE = [
    ("runPolicy.backoffLimit", 7),
    ("runPolicy.activeDeadlineSeconds", 86400),
    ("runPolicy.ttlSecondsAfterFinished", 60),
    ("runPolicy.cleanPodPolicy", "All"),
]


@pytest.mark.parametrize(("field", "value"), IN_PLACE, ids=[f[0] for f in IN_PLACE])
def test_run_policy_changes_apply_in_place(field: str, value: Any) -> None:
    status, pods = run_gang()
    plan = reconcile_training(job(_change(field, value), status, 2), pods, NOW)
    assert plan.status["state"] == "Running" and not plan.delete_pods and not plan.create_pods


def test_changed_config_updates_the_configmap_child() -> None:
    status, pods = run_gang()
    config = "name: custom\ndata: {format: synth, source: tiny}\ntrain: {epochs: 1}\n"
    plan = reconcile_training(job({"config": config}, status, 2), pods, NOW)
    cm = next(c for c in plan.children if c["kind"] == "ConfigMap")
    assert cm["data"]["config.yaml"] == config


def test_pods_without_a_hash_are_left_alone() -> None:
    status, pods = run_gang()
    for p in pods:
        p["metadata"].pop("annotations")
    plan = reconcile_training(job(status=status), pods, NOW)
    assert plan.status["state"] == "Running" and not plan.delete_pods


def test_a_new_operator_version_does_not_restart_running_jobs() -> None:
    """Pods built differently by another operator version (other hash) at the same job generation stay."""
    status, pods = run_gang()
    for p in pods:
        p["metadata"]["annotations"]["grstack.io/spec-hash"] = "0123456789abcdef"
    plan = reconcile_training(job(status=status), pods, NOW)
    assert plan.status["state"] == "Running" and not plan.delete_pods
    old = copy.deepcopy(pods)  # ... and pods from before generations were recorded
    for p in old:
        p["metadata"]["annotations"].pop("grstack.io/generation")
    plan = reconcile_training(job({"image": "grstack:new"}, status, 2), old, NOW)
    assert plan.status["state"] == "Running" and not plan.delete_pods


def test_crd_refuses_a_replica_change_unless_suspended() -> None:
    schema = crds.crd(crds.TRAINING)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    assert any("oldSelf.workers.replicas" in r and "suspend" in r for r in rules)
    # the rule, read as Python, on the transitions it must allow or refuse
    rule = next(r for r in rules if "oldSelf.workers.replicas" in r)

    def allowed(old: dict[str, Any], new: dict[str, Any]) -> bool:
        ns = {"self": _Dot(new), "oldSelf": _Dot(old)}
        return bool(eval(rule.replace("||", " or ").replace("&&", " and "), {}, ns))

    def s(replicas: int, suspend: bool, nproc: int = 1) -> dict[str, Any]:
        return {"workers": {"replicas": replicas, "nprocPerNode": nproc}, "runPolicy": {"suspend": suspend}}

    assert allowed(s(2, False), s(2, False))
    assert not allowed(s(2, False), s(3, False))
    assert allowed(s(2, False), s(3, True))  # suspend and rescale in one update
    assert allowed(s(2, True), s(3, True))
    assert allowed(s(2, True), s(3, False))  # rescale while suspended and resume in one update
    assert not allowed(s(2, False), s(2, False, 2))
    assert allowed(s(2, True), s(2, False, 2))


class _Dot:
    def __init__(self, d: dict[str, Any]) -> None:
        self._d = d

    def __getattr__(self, key: str) -> Any:
        v = self._d[key]
        return _Dot(v) if isinstance(v, dict) else v


def test_training_parse_spec_still_accepts_minimal() -> None:
    assert training.parse_spec(job()).workers.replicas == 2


# ------------------------------------------------------------------------------------ gang scheduling (item 2)


def _pods_of(plan: training.TrainingPlan) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["name"]: p for p in plan.create_pods}


@pytest.mark.parametrize("replicas", [2, 4])
def test_coscheduling_pod_group(replicas: int) -> None:
    spec = {"workers": {"replicas": replicas},
            "runPolicy": {"schedulingPolicy": {"gangScheduler": "Coscheduling", "scheduleTimeoutSeconds": 120}}}
    plan = reconcile_training(job(spec), [], NOW)
    group = next(c for c in plan.children if c["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["metadata"]["name"] == "demo"
    assert group["spec"] == {"minMember": replicas, "scheduleTimeoutSeconds": 120}
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    for p in plan.create_pods:
        assert p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
        assert p["spec"]["schedulerName"] == "scheduler-plugins-scheduler"


def test_volcano_pod_group() -> None:
    spec = {"runPolicy": {"schedulingPolicy": {"gangScheduler": "Volcano", "queue": "research"}}}
    plan = reconcile_training(job(spec), [], NOW)
    group = next(c for c in plan.children if c["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {"minMember": 2, "queue": "research"}
    for p in plan.create_pods:
        assert p["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo"
        assert p["spec"]["schedulerName"] == "volcano"


def test_user_scheduler_name_wins_and_no_group_by_default() -> None:
    spec = {"scheduling": {"schedulerName": "my-cosched"},
            "runPolicy": {"schedulingPolicy": {"gangScheduler": "Coscheduling"}}}
    plan = reconcile_training(job(spec), [], NOW)
    assert all(p["spec"]["schedulerName"] == "my-cosched" for p in plan.create_pods)
    plain = reconcile_training(job(), [], NOW)
    assert not any(c["kind"] == "PodGroup" for c in plain.children)
    assert all("schedulerName" not in p["spec"] for p in plain.create_pods)


@pytest.mark.parametrize("where", ["field", "label"])
def test_a_kueue_queued_job_waits_for_its_workload(where: str) -> None:
    """A job naming a Kueue LocalQueue is queued through the Workload the operator owns (the whole contract:
    tests/operator/test_op_kueue.py): no pod before admission, and no pod-level Kueue label (Kueue's pod
    integration would queue each pod again)."""
    spec = {"runPolicy": {"schedulingPolicy": {"kueueQueueName": "team-a"}}} if where == "field" else {}
    j = job(spec)
    if where == "label":
        j["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    plan = reconcile_training(j, [], NOW)
    assert plan.create_pods == [] and plan.status["state"] == "Suspended"
    assert plan.kueue is not None and plan.kueue.create is not None
    assert plan.kueue.create["spec"]["queueName"] == "team-a"
    assert plan.kueue.create["spec"]["podSets"][0]["count"] == 2


def _pending(p: dict[str, Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    p["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}
    return p


def test_schedule_timeout_releases_a_partial_gang() -> None:
    spec = {"runPolicy": {"schedulingPolicy": {"scheduleTimeoutSeconds": 60}}}
    plan = reconcile_training(job(spec), [], NOW)
    assert "gangStartTime" not in plan.status  # written once the API server has created the pods
    training.record_created(plan, len(plan.create_pods), NOW)
    assert plan.status["gangStartTime"] == "2026-01-01T12:00:00Z"
    pods = as_live(plan.create_pods)
    pods[1] = _pending(pods[1])
    soon = NOW + dt.timedelta(seconds=30)
    plan = reconcile_training(job(spec, plan.status), pods, soon)
    assert plan.status["state"] == "Created" and not plan.delete_pods and plan.requeue_after == 30
    waiting = next(c for c in plan.status["conditions"] if c["type"] == "WorkersWaiting")
    assert waiting["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in waiting["message"]
    assert plan.events[0][:2] == ("Warning", "Unschedulable")
    late = NOW + dt.timedelta(seconds=61)
    plan = reconcile_training(job(spec, plan.status), pods, late)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "GangScheduled")
    assert (cond["status"], cond["reason"]) == ("False", "ScheduleTimeout") and "1/2" in cond["message"]
    assert sorted(plan.delete_pods) == ["demo-worker-0", "demo-worker-1"]
    assert plan.status["restarts"] == 0 and "ScheduleTimeout" in [e[1] for e in plan.events]
    plan = reconcile_training(job(spec, plan.status), [], late)  # released: a new gang
    assert len(plan.create_pods) == 2 and plan.status["state"] != "Failed"


def test_schedule_timeout_leaves_a_wholly_pending_gang() -> None:
    spec = {"runPolicy": {"schedulingPolicy": {"scheduleTimeoutSeconds": 60}}}
    plan = reconcile_training(job(spec), [], NOW)
    pods = [_pending(p) for p in plan.create_pods]
    plan = reconcile_training(job(spec, plan.status), pods, NOW + dt.timedelta(seconds=600))
    assert not plan.delete_pods  # nothing is held: releasing would only lose its place in the queue


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff"])
def test_waiting_reasons_surface_as_condition_and_event(reason: str) -> None:
    plan = reconcile_training(job(), [], NOW)
    pods = as_live(plan.create_pods, "Pending")
    pods[0]["spec"]["nodeName"] = "node-1"
    pods[0]["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {
        "reason": reason, "message": 'Back-off pulling image "grstack:typo"'}}}]
    plan = reconcile_training(job(status=plan.status), pods, NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "WorkersWaiting")
    assert (cond["status"], cond["reason"]) == ("True", reason) and "demo-worker-0" in cond["message"]
    assert plan.events == [("Warning", reason, cond["message"])]
    again = reconcile_training(job(status=plan.status), pods, NOW)
    assert again.events == []  # once per change, not every pass
    fixed = as_live(pods)
    plan = reconcile_training(job(status=again.status), fixed, NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "WorkersWaiting")
    assert cond["status"] == "False" and plan.status["state"] == "Running"


def test_status_schema_keeps_the_new_fields() -> None:
    props = crds.structural_schema(crds.TRAINING.status)["properties"]
    assert "gangStartTime" in props and "gangAttempt" in props


def test_suspend_clears_workers_waiting() -> None:
    plan = reconcile_training(job(), [], NOW)
    pods = as_live(plan.create_pods, "Pending")
    pods[0]["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull"}}}]
    plan = reconcile_training(job(status=plan.status), pods, NOW)
    plan = reconcile_training(job({"runPolicy": {"suspend": True}}, plan.status, 2), pods, NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "WorkersWaiting")
    assert cond["status"] == "False" and plan.status["state"] == "Suspended"

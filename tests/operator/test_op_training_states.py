"""The GRTrainingJob state machine, handler by handler (``training.HANDLERS`` and ``training.ACTIVE_STEPS``),
disruptions (DisruptionTarget) not charged against backoffLimit, creation times written after the pods
exist, and refused writes surfaced in status (``refusals``)."""

from __future__ import annotations

import copy
import datetime as dt
import typing
from typing import Any

import pytest
from training_jobs import NOW, T0, job

from grstack.operator import names, refusals, training
from grstack.operator.models import GRTrainingJobStatus, TrainingState
from grstack.operator.training import Pass, TrainingPlan, reconcile_training

pytestmark = pytest.mark.unit


def running(status: dict[str, Any], phase: str = "Running") -> list[dict[str, Any]]:
    """The pods the last plan asked for, as the cluster would show them."""
    plan = reconcile_training(job(status=status), [], NOW)
    pods = copy.deepcopy(plan.create_pods)
    for p in pods:
        p["status"] = {"phase": phase}
        p["metadata"]["creationTimestamp"] = T0
    return pods


def gang(spec: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job whose 2-pod gang runs: (status, pods)."""
    plan = reconcile_training(job(spec), [], NOW)
    training.record_created(plan, len(plan.create_pods), NOW)
    pods = copy.deepcopy(plan.create_pods)
    for p in pods:
        p["status"] = {"phase": "Running"}
    plan = reconcile_training(job(spec, plan.status), pods, NOW)
    assert plan.status["state"] == "Running" and plan.status["gangAttempt"] == 0
    return plan.status, pods


def make_pass(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None,
              pods: list[dict[str, Any]] | None = None) -> Pass:
    j = job(spec, status)
    st = copy.deepcopy(j["status"])
    st.setdefault("restarts", 0)
    st.setdefault("state", "Created")
    st.setdefault("conditions", [])
    return Pass(job=j, spec=training.parse_spec(j), pods=pods or [], now=NOW, plan=TrainingPlan(status=st))


# ------------------------------------------------------------------------------------------ dispatch


def test_every_state_has_a_handler() -> None:
    assert set(typing.get_args(TrainingState)) <= set(training.HANDLERS)


def test_finished_handler_only_cleans_up_and_keeps_the_state() -> None:
    status, pods = gang({"runPolicy": {"cleanPodPolicy": "All", "ttlSecondsAfterFinished": 60}})
    p = make_pass({"runPolicy": {"cleanPodPolicy": "All", "ttlSecondsAfterFinished": 60}},
                  {**status, "state": "Succeeded", "completionTime": T0}, pods)
    assert training.HANDLERS["Succeeded"](p) is None
    assert sorted(p.plan.delete_pods) == ["demo-worker-0", "demo-worker-1"] and p.plan.delete_job
    assert p.status["state"] == "Succeeded" and not p.plan.create_pods and not p.plan.events


def test_suspended_handler_holds_then_hands_over_to_created() -> None:
    p = make_pass({"runPolicy": {"suspend": True}}, {"state": "Suspended", "startTime": T0})
    assert training.HANDLERS["Suspended"](p) is None and p.status["state"] == "Suspended"
    p = make_pass(None, {"state": "Suspended", "startTime": T0})
    assert training.HANDLERS["Suspended"](p) == "Created"
    assert p.status["state"] == "Created" and "startTime" not in p.status  # the deadline restarts
    assert [e[1] for e in p.plan.events] == ["Resumed"]


def test_active_handler_serves_created_running_and_restarting() -> None:
    assert training.HANDLERS["Created"] is training.HANDLERS["Running"] is training.HANDLERS["Restarting"]
    p = make_pass()
    assert training.HANDLERS["Created"](p) is None
    assert [x["metadata"]["name"] for x in p.plan.create_pods] == ["demo-worker-0", "demo-worker-1"]


def test_an_unknown_state_is_treated_as_active() -> None:
    plan = reconcile_training(job(status={"state": "SomethingNew", "restarts": 0}), [], NOW)
    assert len(plan.create_pods) == 2


# ----------------------------------------------------------------------------------- the active steps


def test_step_suspend() -> None:
    status, pods = gang()
    p = make_pass({"runPolicy": {"suspend": True}}, status, pods)
    assert training._suspend(p) and p.status["state"] == "Suspended"
    assert sorted(p.plan.delete_pods) == ["demo-worker-0", "demo-worker-1"] and "gangAttempt" not in p.status
    assert not training._suspend(make_pass())


def test_step_deadline() -> None:
    spec = {"runPolicy": {"activeDeadlineSeconds": 7200}}
    p = make_pass(spec, {"startTime": T0})
    assert not training._deadline(p) and p.plan.requeue_after == 3600
    p = make_pass({"runPolicy": {"activeDeadlineSeconds": 60}}, {"startTime": T0})
    assert training._deadline(p) and p.status["state"] == "Failed"
    assert training._deadline(p) is True and "DeadlineExceeded" in [e[1] for e in p.plan.events]
    assert not training._deadline(make_pass(spec))  # not started: no deadline yet


def test_step_observe_deletes_stale_pods_and_recovers_lost_start_times() -> None:
    status, pods = gang()
    old = copy.deepcopy(pods[0])
    old["metadata"]["name"] = "demo-worker-0-old"
    old["metadata"]["labels"][names.LABEL_ATTEMPT] = "7"
    for x in pods:
        x["metadata"]["creationTimestamp"] = T0
    status = {k: v for k, v in status.items() if k not in ("startTime", "gangStartTime")}  # a lost write
    p = make_pass(None, status, [*pods, old])
    assert not training._observe(p)
    assert p.plan.delete_pods == ["demo-worker-0-old"]
    assert p.status["startTime"] == T0 and p.status["gangStartTime"] == T0


def test_step_succeeded() -> None:
    status, pods = gang()
    pods[0]["status"]["phase"] = "Succeeded"
    p = make_pass(None, status, pods)
    assert training._succeeded(p) and p.status["state"] == "Succeeded" and p.status["completionTime"]
    status, pods = gang()
    assert not training._succeeded(make_pass(None, status, pods))


def test_step_spec_changed() -> None:
    status, pods = gang()
    p = make_pass(None, status, pods)
    assert not training._spec_changed(p)
    j = job({"workers": {"replicas": 2, "env": [{"name": "X", "value": "1"}]}}, status, generation=2)
    p = Pass(job=j, spec=training.parse_spec(j), pods=pods, now=NOW,
             plan=TrainingPlan(status=copy.deepcopy(status)))
    assert training._spec_changed(p) and p.status["state"] == "Restarting"
    assert p.status["restarts"] == 0 and sorted(p.plan.delete_pods) == ["demo-worker-0", "demo-worker-1"]


def test_step_failed_charges_backoff_limit() -> None:
    status, pods = gang({"runPolicy": {"backoffLimit": 1}})
    pods[1]["status"] = {"phase": "Failed"}
    p = make_pass({"runPolicy": {"backoffLimit": 1}}, status, pods)
    assert training._failed(p) and p.status["restarts"] == 1 and p.status["state"] == "Restarting"
    status = {**p.status, "restarts": 1}
    pods = running(status)
    pods[0]["status"] = {"phase": "Failed"}
    p = make_pass({"runPolicy": {"backoffLimit": 1}}, status, pods)
    assert training._failed(p) and p.status["state"] == "Failed"
    assert next(c for c in p.status["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"


def test_step_schedule_timeout_and_start_gang() -> None:
    p = make_pass({"runPolicy": {"schedulingPolicy": {"scheduleTimeoutSeconds": 60}}})
    assert not training._schedule_timeout(p)
    assert not training._start_gang(p) and len(p.plan.create_pods) == 2
    assert "gangStartTime" not in p.status and "startTime" not in p.status  # not before the pods exist


def test_step_running() -> None:
    status, pods = gang()
    p = make_pass(None, {**status, "state": "Created"}, pods)
    assert training._running(p) and p.status["state"] == "Running"


# --------------------------------------------------------------------------------------- disruptions


def _disrupted(pod: dict[str, Any], how: str) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    if how == "DisruptionTarget":
        pod["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]
        pod["metadata"]["deletionTimestamp"] = T0  # the eviction deletes it gracefully
    elif how == "preempted":
        pod["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "PreemptionByScheduler", "message": "preempted by a-pod"}]
        pod["status"]["phase"] = "Failed"
    else:
        pod["status"] = {"phase": "Failed", "reason": how, "message": "The node was low on resource: memory."}
    return pod


@pytest.mark.parametrize("how", ["DisruptionTarget", "preempted", "Evicted", "Preempting"])
def test_a_disruption_restarts_the_gang_without_charging_backoff_limit(how: str) -> None:
    spec = {"runPolicy": {"backoffLimit": 0}}
    status, pods = gang(spec)
    pods[1] = _disrupted(pods[1], how)
    plan = reconcile_training(job(spec, status), pods, NOW)
    assert plan.status["state"] == "Restarting" and plan.status["restarts"] == 0
    assert plan.status["disruptions"] == 1
    restarting = next(c for c in plan.status["conditions"] if c["type"] == "Restarting")
    assert restarting["reason"] == "WorkerDisrupted" and "demo-worker-1 was disrupted" in restarting["message"]
    assert "not counted against backoffLimit=0" in plan.events[0][2]
    assert "demo-worker-0" in plan.delete_pods
    # the next gang is a new attempt (its pods carry the new label), and still has its whole budget
    plan = reconcile_training(job(spec, plan.status), [], NOW)
    assert {x["metadata"]["labels"][names.LABEL_ATTEMPT] for x in plan.create_pods} == {"1"}
    pods = copy.deepcopy(plan.create_pods)
    for x in pods:
        x["status"] = {"phase": "Running"}
    pods[0]["status"] = {"phase": "Failed"}  # a genuine failure now is charged
    plan = reconcile_training(job(spec, plan.status), pods, NOW)
    assert plan.status["state"] == "Failed" and plan.status["disruptions"] == 1
    assert next(c for c in plan.status["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"


def test_a_user_error_still_fails_when_a_peer_was_disrupted() -> None:
    status, pods = gang()
    pods[0]["status"] = {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {
        "terminated": {"exitCode": 2, "reason": "Error", "message": "error: config"}}}]}
    pods[1] = _disrupted(pods[1], "Evicted")
    plan = reconcile_training(job(status=status), pods, NOW)
    assert plan.status["state"] == "Failed"


def test_a_pod_deleted_without_a_disruption_is_a_charged_loss() -> None:
    status, pods = gang()
    plan = reconcile_training(job(status=status), pods[:1], NOW)
    assert plan.status["restarts"] == 1 and plan.status.get("disruptions", 0) == 0


def test_disruption_reasons() -> None:
    assert training.disruption({"status": {"phase": "Running"}}) is None
    assert training.disruption({"status": {"conditions": [{"type": "DisruptionTarget", "status": "False"}]}}) is None
    assert training.disruption({"status": {"conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]}}) == \
        "DeletionByTaintManager"


# ------------------------------------------------------------------------------- times after creation


def test_start_times_are_written_only_for_created_pods() -> None:
    spec = {"runPolicy": {"activeDeadlineSeconds": 600}}
    plan = reconcile_training(job(spec), [], NOW)
    assert plan.create_pods and "startTime" not in plan.status and "gangStartTime" not in plan.status
    training.record_created(plan, 0, NOW)  # every create refused
    assert "startTime" not in plan.status and plan.requeue_after is None
    later = NOW + dt.timedelta(seconds=5)
    training.record_created(plan, 2, later)
    assert plan.status["startTime"] == plan.status["gangStartTime"] == "2026-01-01T12:00:05Z"
    assert plan.requeue_after == 600


# --------------------------------------------------------------------------------------------- refusals

FORBIDDEN = refusals.Refusal(
    operation="create", kind="Pod", name="demo-worker-0", code=403, reason="Forbidden",
    message='pods "demo-worker-0" is forbidden: violates PodSecurity "restricted:latest": restricted volume '
            'types (volume "data" uses restricted volume type "nfs")')


def test_a_refusal_becomes_condition_event_and_visible_backoff() -> None:
    status: dict[str, Any] = {"conditions": []}
    events = refusals.record(status, FORBIDDEN, 4.0, NOW, 3)
    cond = next(c for c in status["conditions"] if c["type"] == "ReplicaFailure")
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("True", "FailedCreate", 3)
    assert FORBIDDEN.message in cond["message"] and "403 Forbidden" in cond["message"]
    assert events == [("Warning", "FailedCreate", FORBIDDEN.describe())] and FORBIDDEN.message in events[0][2]
    assert status["retries"] == 1 and status["nextRetryTime"] == "2026-01-01T12:00:04Z"
    assert status["lastFailure"]["code"] == 403 and status["lastFailure"]["reason"] == "Forbidden"
    refusals.record(status, FORBIDDEN, 8.0, NOW, 3)
    assert status["retries"] == 2
    GRTrainingJobStatus.model_validate(status)  # the CRD's status schema keeps every field


def test_a_good_pass_clears_the_backoff_and_keeps_the_last_failure() -> None:
    status: dict[str, Any] = {"conditions": []}
    refusals.record(status, FORBIDDEN, 4.0, NOW, 1)
    events = refusals.clear(status, NOW, 1)
    cond = next(c for c in status["conditions"] if c["type"] == "ReplicaFailure")
    assert cond["status"] == "False" and "retries" not in status and "nextRetryTime" not in status
    assert status["lastFailure"]["message"] == FORBIDDEN.message and events[0][0] == "Normal"
    assert refusals.clear(status, NOW, 1) == []  # once


def test_patch_refusals_say_so() -> None:
    refusal = refusals.Refusal("patch", "Service", "demo-workers", 422, "Invalid", "spec.ports: Invalid value")
    assert refusal.condition_reason == "FailedPatch" and refusal.describe().startswith("updating Service")

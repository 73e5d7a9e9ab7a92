"""Kueue's contract for a job kind it does not know (operator/kueue.py and its step in the training
reconcile): the operator's Workload, validated against Kueue's published CRD schema (vendored under data/),
admission, placement, eviction and finish, and jobs that name no queue."""

from __future__ import annotations

import copy
import datetime as dt
import functools
from pathlib import Path
from typing import Any

import pytest
import yaml
from opsim import admit_custom_resource, merge_patch, with_root_fields

from grstack.operator import kueue, names, training
from grstack.operator.kueue import KueueView

pytestmark = pytest.mark.unit

DATA = Path(__file__).with_name("data")
NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
T0 = "2026-01-01T11:00:00Z"  # an hour before NOW


@functools.cache
def schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((DATA / f"kueue.x-k8s.io_{plural}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1beta1"
    return with_root_fields(version["schema"]["openAPIV3Schema"])


def valid(obj: dict[str, Any], old: dict[str, Any] | None = None, plural: str = "workloads") -> dict[str, Any]:
    """The object as the API server would store it; fails on a schema or CEL violation, or when the server
    would prune a field the operator wrote (a field Kueue does not know)."""
    stored, errors = admit_custom_resource(obj, schema(plural), old)
    assert errors == []
    assert _covered(obj, stored), "the API server would prune fields of this object"
    return stored


def _covered(sent: Any, stored: Any) -> bool:
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and _covered(v, stored[k]) for k, v in sent.items()
                                                if v is not None)
    if isinstance(sent, list):
        return isinstance(stored, list) and len(sent) == len(stored) and all(map(_covered, sent, stored))
    return bool(sent == stored)


def job(spec: dict[str, Any] | None = None, status: dict[str, Any] | None = None, generation: int = 1,
        queue: str | None = "team-a", labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "demo", "namespace": "ns", "uid": "uid-1", "generation": generation,
                            "labels": dict(labels or {})}
    if queue:
        meta["labels"][kueue.QUEUE_LABEL] = queue
    base = {"image": "grstack:cpu", "workers": {"replicas": 2, "resources": {"requests": {"cpu": "2",
                                                                                          "memory": "4Gi"}}}}
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "metadata": meta,
            "spec": {**base, **(spec or {})}, "status": status or {}}


def rank0(j: dict[str, Any]) -> dict[str, Any]:
    return training.worker_pod(j, training.parse_spec(j), 0, 0)


def workload(j: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """The operator's Workload as stored (uid, generation, resourceVersion added as by the API server)."""
    j = j or job()
    wl = valid(kueue.build_workload(j, rank0(j), 2, **kwargs))
    wl["metadata"].update(uid="wl-uid", generation=1, resourceVersion="7")
    return wl


def cond(type_: str, status: bool, reason: str, message: str = "", when: str = T0) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message,
            "lastTransitionTime": when, "observedGeneration": 1}


FLAVORS = {
    "a100": {"apiVersion": kueue.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "a100"},
             "spec": {"nodeLabels": {"pool": "a100", "cloud.example/zone": "z1"},
                      "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}},
    "cpu": {"apiVersion": kueue.API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": "cpu"},
            "spec": {"nodeLabels": {"pool": "a100"}}},
}


def admit(wl: dict[str, Any], flavors: dict[str, str] | None = None, checks: list[dict[str, Any]] | None = None,
          when: str = T0) -> dict[str, Any]:
    """What Kueue's scheduler writes when it admits (SetQuotaReservation, SyncAdmittedCondition): validated as
    an update of ``wl``."""
    status = copy.deepcopy(wl.get("status") or {})
    status["admission"] = {"clusterQueue": "cluster-a", "podSetAssignments": [
        {"name": kueue.PODSET, "flavors": flavors or {"cpu": "a100", "memory": "a100"}, "count": 2,
         "resourceUsage": {"cpu": "4", "memory": "8Gi"}}]}
    conds = [c for c in status.get("conditions") or [] if c["type"] not in ("QuotaReserved", "Admitted", "Evicted")]
    conds += [cond("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue cluster-a", when),
              cond("Admitted", True, "Admitted", "The workload is admitted", when)]
    if any(c["type"] == "Evicted" for c in (wl.get("status") or {}).get("conditions") or []):
        conds.append(cond("Evicted", False, "QuotaReserved", "Previously: preempted", when))
    status["conditions"] = conds
    if checks:
        status["admissionChecks"] = checks
    new = {**wl, "status": status}
    valid(new, wl)
    return new


def evict(wl: dict[str, Any], reason: str = "Preempted") -> dict[str, Any]:
    status = copy.deepcopy(wl["status"])
    status["conditions"] = [c for c in status["conditions"] if c["type"] != "Evicted"] + [
        cond("Evicted", True, reason, "Preempted to accommodate a workload (UID: x) due to prioritization in the "
                                      "ClusterQueue")]
    new = {**wl, "status": status}
    valid(new, wl)
    return new


def patched(wl: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A status merge patch applied as the API server would (its resourceVersion is the precondition)."""
    assert patch["metadata"] == {"resourceVersion": wl["metadata"]["resourceVersion"]}
    new = merge_patch(wl, {"status": patch["status"]})
    return valid(new, wl)


def releases(step: kueue.KueueStep) -> bool:
    """Whether the step clears the Workload's admission (returns the quota)."""
    return step.status_patch is not None and "admission" in step.status_patch["status"]


def as_live(pods: list[dict[str, Any]], phase: str = "Running") -> list[dict[str, Any]]:
    out = copy.deepcopy(pods)
    for p in out:
        p["status"] = {"phase": phase}
    return out


# ------------------------------------------------------------------------------------------- the Workload


def test_workload_name_follows_kueue_naming() -> None:
    name = kueue.workload_name(job())
    assert name.startswith("grtrainingjob-demo-") and len(name.rsplit("-", 1)[1]) == 5
    assert name == kueue.workload_name(job(spec={"image": "other"}))
    other = job()
    other["metadata"]["uid"] = "uid-2"
    assert kueue.workload_name(other) != name  # a job recreated under the same name gets its own Workload
    long = job()
    long["metadata"]["name"] = "x" * 300
    assert len(kueue.workload_name(long)) == 253


@pytest.mark.parametrize("where", ["label", "field"])
def test_workload_pod_set_and_ownership(where: str) -> None:
    spec = {"runPolicy": {"schedulingPolicy": {"kueueQueueName": "team-b"}}} if where == "field" else {}
    j = job(spec, queue="team-a" if where == "label" else None)
    pod = rank0(j)
    wl = kueue.build_workload(j, pod, 2)
    valid(wl)
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta1" and wl["kind"] == "Workload"
    assert wl["metadata"]["namespace"] == "ns" and wl["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == "uid-1"
    (owner,) = wl["metadata"]["ownerReferences"]
    assert owner == {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "name": "demo", "uid": "uid-1",
                     "controller": True, "blockOwnerDeletion": True}
    assert wl["spec"]["queueName"] == ("team-a" if where == "label" else "team-b")
    assert wl["spec"]["active"] is True and "priority" not in wl["spec"]
    (podset,) = wl["spec"]["podSets"]
    assert podset["name"] == "workers" and podset["count"] == 2 and "minCount" not in podset
    (container,) = podset["template"]["spec"]["containers"]
    assert container["resources"] == pod["spec"]["containers"][0]["resources"]
    assert container["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}
    labels = podset["template"]["metadata"]["labels"]
    assert labels[names.LABEL_JOB] == "demo" and names.LABEL_RANK not in labels and names.LABEL_ATTEMPT not in labels


def test_workload_carries_placement_sidecars_and_priority() -> None:
    j = job({"scheduling": {"priorityClassName": "high", "nodeSelector": {"disk": "ssd"},
                            "tolerations": [{"key": "spot", "operator": "Exists"}]},
             "workers": {"replicas": 3, "resources": {"requests": {"cpu": "1"}},
                         "template": {"spec": {"containers": [{"name": "log-shipper", "image": "busybox",
                                                               "resources": {"requests": {"cpu": "100m"}}}]}}}})
    assert kueue.priority_ref(j) == kueue.PriorityRef(kueue.SOURCE_POD_PRIORITY, "high")
    wl = kueue.build_workload(j, rank0(j), 3, priority=(kueue.priority_ref(j), 1000))  # type: ignore[arg-type]
    valid(wl)
    assert wl["spec"]["priorityClassName"] == "high" and wl["spec"]["priority"] == 1000
    assert wl["spec"]["priorityClassSource"] == "scheduling.k8s.io/priorityclass"
    template = wl["spec"]["podSets"][0]["template"]["spec"]
    assert [c["name"] for c in template["containers"]] == ["trainer", "log-shipper"]
    assert template["containers"][1]["resources"] == {"requests": {"cpu": "100m"}}
    assert template["nodeSelector"] == {"disk": "ssd"} and template["priorityClassName"] == "high"
    assert template["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    labelled = job(labels={kueue.PRIORITY_LABEL: "batch-low"})
    assert kueue.priority_ref(labelled) == kueue.PriorityRef(kueue.SOURCE_WORKLOAD_PRIORITY, "batch-low")


def test_the_vendored_schema_refuses_what_kueue_refuses() -> None:
    """The schema checks are real: a priority class without a priority, an admission with a missing pod set,
    a changed queue while quota is reserved."""
    wl = workload()
    bad = copy.deepcopy(wl)
    bad["spec"]["priorityClassName"] = "high"
    assert admit_custom_resource(bad, schema("workloads"))[1]
    admitted = admit(wl)
    bad = copy.deepcopy(admitted)
    bad["status"]["admission"]["podSetAssignments"] = []
    assert admit_custom_resource(bad, schema("workloads"), admitted)[1]
    moved = copy.deepcopy(admitted)
    moved["spec"]["queueName"] = "team-b"
    errors = admit_custom_resource(moved, schema("workloads"), admitted)[1]
    assert any("queueName is immutable" in e for e in errors)
    for flavor in FLAVORS.values():
        valid(flavor, plural="resourceflavors")


def test_a_job_without_a_queue_is_not_queued() -> None:
    j = job(queue=None)
    assert kueue.queue_name(j) is None
    with pytest.raises(ValueError, match="not queued"):
        kueue.build_workload(j, rank0(j), 2)


# ------------------------------------------------------------------------------ admission and placement


def test_admission_conditions() -> None:
    wl = workload()
    assert not kueue.admitted(wl)
    reserved = copy.deepcopy(wl)
    reserved["status"] = {"admission": admit(wl)["status"]["admission"],
                          "conditions": [cond("QuotaReserved", True, "QuotaReserved"),
                                         cond("Admitted", False, "UnsatisfiedChecks")]}
    assert kueue.has_quota(reserved) and not kueue.admitted(reserved)  # an admission check is not ready yet
    assert kueue.admitted(admit(wl))
    assert not kueue.admitted(evict(admit(wl)))
    assert kueue.flavor_names(admit(wl, {"cpu": "a100", "memory": "cpu"})) == ["a100", "cpu"]


def test_placement_from_flavors_and_admission_checks() -> None:
    checks = [{"name": "prov", "state": "Ready", "message": "", "lastTransitionTime": T0,
               "podSetUpdates": [{"name": "workers", "nodeSelector": {"cloud.example/reservation": "r1"},
                                  "labels": {"team": "a"}, "annotations": {"note": "x"},
                                  "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                                  {"key": "reserved", "operator": "Exists"}]}]}]
    wl = admit(workload(), {"cpu": "a100", "memory": "cpu"}, checks)
    info = kueue.podset_info(wl, FLAVORS)
    assert info.cluster_queue == "cluster-a"
    assert info.node_selector == {"pool": "a100", "cloud.example/zone": "z1", "cloud.example/reservation": "r1"}
    assert info.tolerations == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                {"key": "reserved", "operator": "Exists"}]
    assert info.labels == {"kueue.x-k8s.io/podset": "workers", "team": "a"} and info.annotations == {"note": "x"}
    j = job({"scheduling": {"nodeSelector": {"disk": "ssd"}}})
    pod = kueue.inject(rank0(j), info)
    assert pod["spec"]["nodeSelector"] == {"disk": "ssd", **info.node_selector}
    assert pod["spec"]["tolerations"] == info.tolerations
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "workers"
    assert pod["metadata"]["annotations"]["note"] == "x"


def test_placement_problems() -> None:
    wl = admit(workload())
    with pytest.raises(kueue.AdmissionProblem) as missing:
        kueue.podset_info(wl, {})
    assert not missing.value.permanent and "a100" in str(missing.value)
    clash = job({"scheduling": {"nodeSelector": {"pool": "h100"}}})
    with pytest.raises(kueue.AdmissionProblem, match="pool=a100 conflicts with pool=h100") as conflict:
        kueue.inject(rank0(clash), kueue.podset_info(wl, FLAVORS))
    assert conflict.value.permanent


# ------------------------------------------------------------------------------ eviction, release, finish


@pytest.mark.parametrize(("reason", "requeued"), [("Preempted", "True"), ("Deactivated", "False")])
def test_release_after_eviction(reason: str, requeued: str) -> None:
    wl = evict(admit(workload()), reason)
    out = patched(wl, kueue.release(wl, NOW))
    assert "admission" not in out["status"]
    conds = {c["type"]: c for c in out["status"]["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and conds["QuotaReserved"]["reason"] == "Pending"
    assert conds["Admitted"]["status"] == "False" and conds["Admitted"]["reason"] == "NoReservation"
    assert conds["Requeued"]["status"] == requeued and conds["Requeued"]["reason"] == reason
    assert conds["Evicted"]["status"] == "True"  # Kueue resets it when it admits again
    assert out["status"]["accumulatedPastExexcutionTimeSeconds"] == 3600  # admitted at T0, released at NOW
    again = admit(out, when="2026-01-01T12:30:00Z")
    assert kueue.admitted(again)


def test_finish() -> None:
    wl = admit(workload())
    out = patched(wl, kueue.finish(wl, "Succeeded", "rank 0 finished", NOW))
    finished = next(c for c in out["status"]["conditions"] if c["type"] == "Finished")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded" and finished["observedGeneration"] == 1
    assert kueue.finished(KueueView(workload=out), "Succeeded", "done", NOW).status_patch is None  # once


def test_pods_ready_as_kueue_reports_it() -> None:
    """Kueue's waitForPodsReady evicts a Workload whose pods never report ready: the operator reports them."""
    wl = admit(workload())
    started = patched(wl, kueue.pods_ready(wl, True, NOW))  # type: ignore[arg-type]
    assert kueue.pods_ready(started, True, NOW) is None  # unchanged: no write
    (ready,) = (c for c in started["status"]["conditions"] if c["type"] == "PodsReady")
    assert (ready["status"], ready["reason"]) == ("True", "Started")
    broken = patched(started, kueue.pods_ready(started, False, NOW))  # type: ignore[arg-type]
    assert next(c for c in broken["status"]["conditions"] if c["type"] == "PodsReady")["reason"] == "WaitForRecovery"
    healed = patched(broken, kueue.pods_ready(broken, True, NOW))  # type: ignore[arg-type]
    assert next(c for c in healed["status"]["conditions"] if c["type"] == "PodsReady")["reason"] == "Recovered"
    waiting = patched(wl, kueue.pods_ready(wl, False, NOW))  # type: ignore[arg-type]
    assert next(c for c in waiting["status"]["conditions"] if c["type"] == "PodsReady")["reason"] == "WaitForStart"


# ---------------------------------------------------------------------------------------- one pass's step


def _step(j: dict[str, Any], view: KueueView, suspend: bool = False, pods_active: bool = False) -> kueue.KueueStep:
    return kueue.step(j, rank0(j), 2, suspend, view, pods_active, NOW)


def test_step_creates_then_waits_then_admits() -> None:
    j = job()
    first = _step(j, KueueView())
    assert first.create is not None and first.hold is not None and first.hold[0] == "WaitingForAdmission"
    assert first.info is None and [e[1] for e in first.events] == ["CreatedWorkload"]
    wl = workload()
    wl["status"] = {"conditions": [cond("QuotaReserved", False, "Pending",
                                        "couldn't assign flavors to pod set workers: insufficient quota for cpu")]}
    pending = _step(j, KueueView(workload=wl))
    assert pending.create is None and pending.hold is not None and "insufficient quota for cpu" in pending.hold[1]
    ready = _step(j, KueueView(workload=admit(workload()), flavors=FLAVORS))
    assert ready.hold is None and ready.info is not None and ready.info.node_selector["pool"] == "a100"
    assert ready.spec_patch is None and ready.create is None and not releases(ready)


def test_step_eviction_releases_only_once_the_pods_are_gone() -> None:
    j = job()
    wl = evict(admit(workload()))
    running = _step(j, KueueView(workload=wl, flavors=FLAVORS), pods_active=True)
    assert running.hold is not None and running.hold[0] == "Evicted" and not releases(running)
    stopped = _step(j, KueueView(workload=wl, flavors=FLAVORS), pods_active=False)
    assert releases(stopped)
    released = patched(wl, stopped.status_patch)  # type: ignore[arg-type]
    again = _step(j, KueueView(workload=released))
    assert again.hold is not None and not releases(again)  # evicted, no quota: waits for Kueue


def test_step_suspend_deactivates_and_problems_hold() -> None:
    j = job()
    out = _step(j, KueueView(workload=admit(workload())), suspend=True)
    assert out.spec_patch == {"spec": {"active": False}}
    inactive = workload(active=False)
    assert _step(j, KueueView(workload=inactive)).spec_patch == {"spec": {"active": True}}
    missing = _step(j, KueueView(problem="no Kueue"))
    assert missing.hold == ("KueueUnavailable", "no Kueue") and missing.create is None
    prio = job({"scheduling": {"priorityClassName": "high"}})
    unknown = _step(prio, KueueView())
    assert unknown.hold is not None and "PriorityClass high not found" in unknown.hold[1] and unknown.create is None
    known = _step(prio, KueueView(priority=100))
    assert known.create is not None and known.create["spec"]["priority"] == 100


def test_step_replaces_an_out_of_date_workload() -> None:
    old = admit(workload())
    changed = job({"workers": {"replicas": 2, "resources": {"requests": {"cpu": "3"}}}})
    busy = _step(changed, KueueView(workload=old), pods_active=True)
    assert busy.hold is not None and busy.hold[0] == "WorkloadChanged" and busy.delete is None
    idle = _step(changed, KueueView(workload=old))
    assert idle.delete == old["metadata"]["name"] and idle.create is None
    moved = _step(job(queue="team-b"), KueueView(workload=old))
    assert moved.hold is not None and moved.hold[0] == "WorkloadChanged"
    image = _step(job({"image": "grstack:v2"}), KueueView(workload=old, flavors=FLAVORS))
    assert image.hold is None and image.delete is None  # not Kueue's concern: the same admission holds


def test_step_permanent_conflict_finishes_the_workload() -> None:
    clash = job({"scheduling": {"nodeSelector": {"pool": "h100"}}})
    wl = admit(workload(clash))
    out = _step(clash, KueueView(workload=wl, flavors=FLAVORS))
    assert out.hold is not None and out.hold[0] == "AdmissionFailed" and out.status_patch is not None
    finished = patched(wl, out.status_patch)
    assert kueue.is_true(finished, "Finished")
    assert next(c for c in finished["status"]["conditions"] if c["type"] == "Finished")["reason"] == "FailedToStart"


# ------------------------------------------------------------------------------- the training reconcile


def _pass(j: dict[str, Any], pods: list[dict[str, Any]], view: KueueView | None) -> training.TrainingPlan:
    return training.reconcile_training(j, pods, NOW, kueue_view=view)


def _suspended(plan: training.TrainingPlan) -> dict[str, Any]:
    return next(c for c in plan.status["conditions"] if c["type"] == "Suspended")


def _admitted_gang() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """A queued job whose Workload was admitted and whose gang runs: (status, Workload, live pods)."""
    plan = _pass(job(), [], None)
    wl = admit(workload())
    plan = _pass(job(status=plan.status), [], KueueView(workload=wl, flavors=FLAVORS))
    pods = as_live(plan.create_pods)
    plan = _pass(job(status=plan.status), pods, KueueView(workload=wl, flavors=FLAVORS))
    assert plan.status["state"] == "Running"
    return plan.status, wl, pods


def test_a_queued_job_has_no_pods_until_its_workload_is_admitted() -> None:
    plan = _pass(job(), [], None)
    assert plan.create_pods == [] and plan.status["state"] == "Suspended"
    assert _suspended(plan)["reason"] == "WaitingForAdmission"
    assert plan.kueue is not None and plan.kueue.create is not None
    valid(plan.kueue.create)
    assert ("Normal", "CreatedWorkload") in [e[:2] for e in plan.events]
    pending = workload()
    pending["status"] = {"conditions": [cond("QuotaReserved", False, "Pending", "insufficient quota for cpu")]}
    plan = _pass(job(status=plan.status), [], KueueView(workload=pending))
    assert plan.create_pods == [] and plan.kueue is not None and plan.kueue.create is None
    assert "insufficient quota for cpu" in _suspended(plan)["message"]
    plan = _pass(job(status=plan.status), [], KueueView(workload=admit(workload()), flavors=FLAVORS))
    assert len(plan.create_pods) == 2 and plan.status["state"] == "Created"
    resumed = _suspended(plan)
    assert resumed["status"] == "False" and resumed["reason"] == "JobResumed" and "cluster-a" in resumed["message"]
    for pod in plan.create_pods:
        assert pod["spec"]["nodeSelector"] == {"pool": "a100", "cloud.example/zone": "z1"}
        assert {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
        assert pod["metadata"]["labels"][kueue.PODSET_LABEL] == "workers"
        assert kueue.QUEUE_LABEL not in pod["metadata"]["labels"]  # Kueue's pod integration must not queue it
        assert not any(k.startswith("kueue.x-k8s.io/pod-group") for k in {**pod["metadata"]["labels"],
                                                                          **pod["metadata"]["annotations"]})


def test_an_eviction_stops_the_gang_and_the_next_admission_resumes_it_uncharged() -> None:
    status, wl, pods = _admitted_gang()
    evicted = evict(wl)
    plan = _pass(job(status=status), pods, KueueView(workload=evicted, flavors=FLAVORS))
    assert sorted(plan.delete_pods) == ["demo-worker-0", "demo-worker-1"] and plan.create_pods == []
    assert plan.status["state"] == "Suspended" and _suspended(plan)["reason"] == "Evicted"
    assert "Preempted" in _suspended(plan)["message"] and plan.status["restarts"] == 0
    assert plan.kueue is not None and not releases(plan.kueue)  # pods still there: quota kept
    plan = _pass(job(status=plan.status), [], KueueView(workload=evicted, flavors=FLAVORS))
    assert plan.kueue is not None and releases(plan.kueue) and plan.create_pods == []
    released = patched(evicted, plan.kueue.status_patch)  # type: ignore[arg-type]
    plan = _pass(job(status=plan.status), [], KueueView(workload=released))
    assert plan.create_pods == [] and plan.kueue is not None and not releases(plan.kueue)
    plan = _pass(job(status=plan.status), [], KueueView(workload=admit(released), flavors=FLAVORS))
    assert len(plan.create_pods) == 2 and plan.status["restarts"] == 0
    assert "gangAttempt" not in plan.status  # the resumed gang is not read as a lost worker


@pytest.mark.parametrize(("phase", "exit_code", "state"), [("Succeeded", 0, "Succeeded"), ("Failed", 2, "Failed")])
def test_the_end_of_the_job_finishes_its_workload(phase: str, exit_code: int, state: str) -> None:
    status, wl, pods = _admitted_gang()
    pods[0]["status"] = {"phase": phase, "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": exit_code}}}]}
    plan = _pass(job(status=status), pods, KueueView(workload=wl, flavors=FLAVORS))
    assert plan.status["state"] == state and plan.kueue is not None and plan.kueue.status_patch is not None
    done = patched(wl, plan.kueue.status_patch)
    finished = next(c for c in done["status"]["conditions"] if c["type"] == "Finished")
    assert finished["status"] == "True" and finished["reason"] == state
    plan = _pass(job(status=plan.status), pods, KueueView(workload=done))
    assert plan.kueue is not None and plan.kueue.status_patch is None


def test_suspending_a_queued_job_deactivates_its_workload() -> None:
    status, wl, pods = _admitted_gang()
    plan = _pass(job({"runPolicy": {"suspend": True}}, status), pods, KueueView(workload=wl, flavors=FLAVORS))
    assert plan.status["state"] == "Suspended" and _suspended(plan)["reason"] == "JobSuspended"
    assert plan.kueue is not None and plan.kueue.spec_patch == {"spec": {"active": False}}
    assert sorted(plan.delete_pods) == ["demo-worker-0", "demo-worker-1"]


def test_kueue_problems_hold_the_job_with_a_warning() -> None:
    plan = _pass(job(), [], KueueView(problem="this cluster serves no kueue.x-k8s.io/v1beta1 Workload"))
    assert plan.create_pods == [] and _suspended(plan)["reason"] == "KueueUnavailable"
    assert ("Warning", "KueueUnavailable") in [e[:2] for e in plan.events]
    again = _pass(job(status=plan.status), [], KueueView(problem="this cluster serves no kueue.x-k8s.io/v1beta1 "
                                                                   "Workload"))
    assert again.events == []  # once per change


def test_a_job_without_a_queue_is_untouched() -> None:
    plan = _pass(job(queue=None), [], None)
    assert plan.kueue is None and len(plan.create_pods) == 2 and plan.status["state"] == "Created"
    for pod in plan.create_pods:
        assert not any(k.startswith("kueue.x-k8s.io/") for k in pod["metadata"]["labels"])
        assert "nodeSelector" not in pod["spec"]


def test_the_chart_allows_the_kueue_calls() -> None:
    from test_op_chart import SCENARIOS, _allowed, kinds, render

    for values in ({}, SCENARIOS["namespaced-operator"]):
        docs = kinds(render(values))
        namespaced = (docs.get("Role") or [None])[0] or next(r for r in docs["ClusterRole"]
                                                             if r["metadata"]["name"] == "grstack")
        cluster = next(r for r in docs["ClusterRole"] if r["metadata"]["name"] == "grstack-crds")["rules"]
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert _allowed(namespaced["rules"], "kueue.x-k8s.io", "workloads", verb)
        assert _allowed(namespaced["rules"], "kueue.x-k8s.io", "workloads/status", "patch")
        for group, plural in (("kueue.x-k8s.io", "resourceflavors"), ("kueue.x-k8s.io", "workloadpriorityclasses"),
                              ("scheduling.k8s.io", "priorityclasses")):
            assert _allowed(cluster, group, plural, "get")

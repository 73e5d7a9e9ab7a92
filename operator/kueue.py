"""Kueue's contract for a job kind it has no integration for: the operator owns one ``kueue.x-k8s.io``
``Workload`` per queued GRTrainingJob and plays the part of Kueue's ``jobframework`` job reconciler.

A job is queued when it names a LocalQueue (the label ``kueue.x-k8s.io/queue-name`` or
``spec.runPolicy.schedulingPolicy.kueueQueueName``). For such a job the operator

- creates the Workload (pod set ``workers``: count = replicas, the pod template's resources and placement,
  the priority of its PriorityClass or WorkloadPriorityClass; controller ownerReference to the job) and
  creates no pod until Kueue admits it (``status.admission`` set and condition ``Admitted`` True);
- gives the pods the admission's placement: the assigned ResourceFlavors' ``nodeLabels`` and
  ``tolerations`` and the admission checks' ``podSetUpdates`` (Kueue's ``podset.FromAssignment`` and
  ``Merge``);
- on eviction (``Evicted`` True) deletes the pods and, once none is left, clears the admission
  (``QuotaReserved`` False, ``Requeued``), so Kueue can queue it again; ``runPolicy.suspend`` maps to the
  Workload's ``spec.active``;
- marks the Workload ``Finished`` when the job ends; the garbage collector deletes it with the job.

The functions below are pure (the reconcile decides with them); ``observe`` and ``apply`` are the thin
adapter to the API server. ``kueue.x-k8s.io/v1beta1`` is used: served by every Kueue release with this API
(deprecated, still served, since v1beta2 became the storage version).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grstack.operator import names, objects

if TYPE_CHECKING:
    from grstack.operator.kube import KubeClient

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta1"
WORKLOAD_KIND = "Workload"
WORKLOAD_PLURAL = "workloads"
FLAVOR_PLURAL = "resourceflavors"
PRIORITY_CLASS_PLURAL = "workloadpriorityclasses"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"  # a WorkloadPriorityClass, as on Kueue's own integrations
PODSET_LABEL = f"{GROUP}/podset"  # Kueue labels a started pod with its pod set
JOB_UID_LABEL = f"{GROUP}/job-uid"
PODSET = "workers"
ANNOTATION_PODSETS = f"{names.GROUP}/podsets-hash"  # queue, pod sets, priority it was built from (a change re-queues)
SOURCE_POD_PRIORITY = "scheduling.k8s.io/priorityclass"
SOURCE_WORKLOAD_PRIORITY = f"{GROUP}/workloadpriorityclass"
FAILED_TO_START = "FailedToStart"
# Eviction reasons after which Kueue puts the Workload back in the queue by itself (jobframework's rule).
REQUEUED_REASONS = ("Preempted", "NodeFailures")
# PodSpec fields Kueue reads from a pod set template (quota, flavor matching, taints, priority).
_PLACEMENT = ("nodeSelector", "affinity", "tolerations", "priorityClassName", "runtimeClassName", "overhead")
_MAX_NAME = 253
_HASH = 5


# ------------------------------------------------------------------------------------------ the job side


def queue_name(job: dict[str, Any]) -> str | None:
    """The LocalQueue a job is submitted to (the spec field wins over the label), or None: not queued."""
    policy = (((job.get("spec") or {}).get("runPolicy") or {}).get("schedulingPolicy") or {})
    return policy.get("kueueQueueName") or (job["metadata"].get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(job: dict[str, Any]) -> str:
    """Kueue's ``GetWorkloadNameForOwnerWithGVK``: ``<kind>-<name>-<5 hex of sha1(kind, group, name, uid)>``."""
    meta = job["metadata"]
    digest = hashlib.sha1("\n".join((names.TRAINING_KIND, names.GROUP, meta["name"], meta.get("uid") or ""))
                          .encode()).hexdigest()[:_HASH]
    prefix = f"{names.TRAINING_KIND.lower()}-{meta['name']}"[:_MAX_NAME - 1 - _HASH]
    return f"{prefix}-{digest}"


@dataclass(frozen=True)
class PriorityRef:
    source: str  # SOURCE_POD_PRIORITY or SOURCE_WORKLOAD_PRIORITY
    name: str


def priority_ref(job: dict[str, Any]) -> PriorityRef | None:
    """Which priority class sets the Workload's priority: the job's ``kueue.x-k8s.io/priority-class`` label
    (a WorkloadPriorityClass) first, then the pods' PriorityClass, as Kueue's integrations decide."""
    label = (job["metadata"].get("labels") or {}).get(PRIORITY_LABEL)
    if label:
        return PriorityRef(SOURCE_WORKLOAD_PRIORITY, label)
    spec = job.get("spec") or {}
    template = (((spec.get("workers") or {}).get("template") or {}).get("spec") or {})
    name = template.get("priorityClassName") or (spec.get("scheduling") or {}).get("priorityClassName")
    return PriorityRef(SOURCE_POD_PRIORITY, name) if name else None


def _container(c: dict[str, Any], init: bool) -> dict[str, Any]:
    out = {k: c[k] for k in ("name", "resources") if c.get(k) is not None}
    if init and c.get("restartPolicy"):  # a sidecar init container counts like a container
        out["restartPolicy"] = c["restartPolicy"]
    return out


def pod_template(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod set template from a desired worker pod: what Kueue accounts and places (requests, node
    selection, tolerations, priority), without what differs per rank or attempt or does not concern Kueue
    (images, env, commands: a change of those restarts the gang under the same admission)."""
    spec = pod["spec"]
    out: dict[str, Any] = {"containers": [_container(c, False) for c in spec["containers"]]}
    if spec.get("initContainers"):
        out["initContainers"] = [_container(c, True) for c in spec["initContainers"]]
    out.update({k: spec[k] for k in _PLACEMENT if spec.get(k)})
    labels = {k: v for k, v in (pod["metadata"].get("labels") or {}).items()
              if k not in (names.LABEL_RANK, names.LABEL_ATTEMPT)}
    return {"metadata": {"labels": labels}, "spec": out}


def pod_sets(pod: dict[str, Any], replicas: int) -> list[dict[str, Any]]:
    """One pod set: the gang needs every rank, so no ``minCount`` (partial admission would change
    WORLD_SIZE)."""
    return [{"name": PODSET, "count": replicas, "template": pod_template(pod)}]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def build_workload(job: dict[str, Any], pod: dict[str, Any], replicas: int, *, active: bool = True,
                   priority: tuple[PriorityRef, int] | None = None) -> dict[str, Any]:
    """The Workload of a queued job, as Kueue's ``ConstructWorkload`` builds one for its own kinds (without
    the ``resource-in-use`` finalizer: nothing would remove it once the job and its operator are gone)."""
    meta = job["metadata"]
    queue = queue_name(job)
    if not queue:
        raise ValueError(f"GRTrainingJob {meta['name']} is not queued")
    sets = pod_sets(pod, replicas)
    spec: dict[str, Any] = {"queueName": queue, "podSets": sets, "active": active}
    if priority is not None:
        ref, value = priority
        spec.update(priorityClassName=ref.name, priorityClassSource=ref.source, priority=value)
    labels = {names.LABEL_NAME: "grstack", names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_JOB: meta["name"]}
    if meta.get("uid"):
        labels[JOB_UID_LABEL] = meta["uid"]
    return {
        "apiVersion": API_VERSION, "kind": WORKLOAD_KIND,
        "metadata": objects.metadata(job, workload_name(job), labels,
                                     {ANNOTATION_PODSETS: _digest({"queue": queue, "podSets": sets, "priority": (
                                         priority and [priority[0].source, priority[0].name, priority[1]])})}),
        "spec": spec,
    }


# ------------------------------------------------------------------------------------- the Workload side


def _cond(wl: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return objects.condition(((wl or {}).get("status") or {}).get("conditions") or [], type_)


def is_true(wl: dict[str, Any] | None, type_: str) -> bool:
    cond = _cond(wl, type_)
    return cond is not None and cond.get("status") == "True"


def has_quota(wl: dict[str, Any] | None) -> bool:
    return bool(((wl or {}).get("status") or {}).get("admission")) and is_true(wl, "QuotaReserved")


def admitted(wl: dict[str, Any] | None) -> bool:
    """Kueue's ``IsAdmitted``, and nothing taking it back: quota reserved, every admission check ready
    (condition Admitted), not evicted, not finished."""
    return (has_quota(wl) and is_true(wl, "Admitted") and not is_true(wl, "Evicted")
            and not is_true(wl, "Finished"))


def flavor_names(wl: dict[str, Any] | None) -> list[str]:
    """The ResourceFlavors an admission assigns (to read their node labels and tolerations)."""
    admission = ((wl or {}).get("status") or {}).get("admission") or {}
    found: list[str] = []
    for assignment in admission.get("podSetAssignments") or []:
        for flavor in (assignment.get("flavors") or {}).values():
            if flavor not in found:
                found.append(flavor)
    return found


@dataclass
class PodSetInfo:
    """What an admission adds to the pods of a pod set (Kueue's ``podset.PodSetInfo``)."""
    cluster_queue: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


class AdmissionProblem(ValueError):
    """An admission that cannot be applied: a flavor that cannot be read, or admission checks whose pod set
    updates conflict (Kueue finishes such a Workload with reason FailedToStart)."""

    def __init__(self, message: str, permanent: bool) -> None:
        super().__init__(message)
        self.permanent = permanent


def _merge_map(into: dict[str, str], extra: dict[str, str] | None, what: str, source: str) -> None:
    for key, value in (extra or {}).items():
        if key in into and into[key] != value:
            raise AdmissionProblem(f"{source}: {what} {key}={value} conflicts with {key}={into[key]}", True)
        into[key] = value


def podset_info(wl: dict[str, Any], flavors: dict[str, dict[str, Any]], podset: str = PODSET) -> PodSetInfo:
    """The placement of an admitted pod set: the assigned flavors' ``spec.nodeLabels`` and
    ``spec.tolerations``, then each admission check's ``podSetUpdates`` for it (conflicting values refused,
    tolerations de-duplicated), and the pod set label."""
    status = wl.get("status") or {}
    admission = status.get("admission") or {}
    assignment = next((a for a in admission.get("podSetAssignments") or [] if a.get("name", "main") == podset),
                      None)
    if assignment is None:
        raise AdmissionProblem(f"the admission of Workload {wl['metadata']['name']} has no pod set {podset}", True)
    info = PodSetInfo(cluster_queue=admission.get("clusterQueue") or "", labels={PODSET_LABEL: podset})
    for name in dict.fromkeys((assignment.get("flavors") or {}).values()):
        flavor = flavors.get(name)
        if flavor is None:
            raise AdmissionProblem(f"ResourceFlavor {name} (assigned by the admission) could not be read", False)
        fspec = flavor.get("spec") or {}
        info.node_selector.update(fspec.get("nodeLabels") or {})
        info.tolerations += [dict(t) for t in fspec.get("tolerations") or [] if t not in info.tolerations]
    for check in status.get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            if update.get("name") != podset:
                continue
            source = f"admission check {check.get('name')}"
            _merge_map(info.annotations, update.get("annotations"), "annotation", source)
            _merge_map(info.labels, update.get("labels"), "label", source)
            _merge_map(info.node_selector, update.get("nodeSelector"), "nodeSelector", source)
            info.tolerations += [dict(t) for t in update.get("tolerations") or [] if t not in info.tolerations]
    return info


def inject(pod: dict[str, Any], info: PodSetInfo) -> dict[str, Any]:
    """The pod with the admission's placement merged in (Kueue's ``podset.Merge``): a node selector, label
    or annotation the pod already sets to another value is a conflict (AdmissionProblem)."""
    out = json.loads(json.dumps(pod))
    meta, spec = out["metadata"], out["spec"]
    where = f"pod {meta['name']}"
    labels = dict(meta.get("labels") or {})
    _merge_map(labels, info.labels, "label", where)
    annotations = dict(meta.get("annotations") or {})
    _merge_map(annotations, info.annotations, "annotation", where)
    selector = dict(spec.get("nodeSelector") or {})
    _merge_map(selector, info.node_selector, "nodeSelector", where)
    meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    if selector:
        spec["nodeSelector"] = selector
    tolerations = list(spec.get("tolerations") or [])
    tolerations += [t for t in info.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    return out


def _generation(wl: dict[str, Any]) -> int:
    return int(wl["metadata"].get("generation") or 1)


def _set(conds: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str, now: dt.datetime,
         generation: int) -> list[dict[str, Any]]:
    """metav1.Condition on a Workload (its schema requires an integer observedGeneration)."""
    return objects.set_condition(conds, type_, status, reason, message[:32768], now, generation)


def _status_patch(wl: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """A merge patch for the status subresource; the resourceVersion makes it conditional (409 when Kueue
    wrote in between), since a merge patch replaces the whole conditions list."""
    return {"metadata": {"resourceVersion": wl["metadata"].get("resourceVersion")}, "status": status}


def release(wl: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
    """What Kueue's job reconciler writes once an evicted job has stopped: the admission cleared
    (``QuotaReserved``/``Admitted`` False), ``Requeued`` (True when Kueue requeues by itself: preemption,
    node failures), the admitted time accumulated."""
    evicted = _cond(wl, "Evicted") or {}
    reason, message = evicted.get("reason") or "Evicted", evicted.get("message") or "evicted"
    gen = _generation(wl)
    status = wl.get("status") or {}
    conds = list(status.get("conditions") or [])
    out: dict[str, Any] = {"admission": None}
    admitted_cond = _cond(wl, "Admitted")
    if admitted_cond is not None and admitted_cond.get("status") == "True":
        since = objects.parse_time(admitted_cond.get("lastTransitionTime"))
        if since is not None:
            past = int(status.get("accumulatedPastExexcutionTimeSeconds") or 0)
            out["accumulatedPastExexcutionTimeSeconds"] = past + max(0, int((now - since).total_seconds()))
    conds = _set(conds, "Requeued", reason in REQUEUED_REASONS, reason, message, now, gen)
    conds = _set(conds, "QuotaReserved", False, "Pending", message, now, gen)
    if admitted_cond is not None:
        conds = _set(conds, "Admitted", False, "NoReservation", "The workload has no reservation", now, gen)
    out["conditions"] = conds
    return _status_patch(wl, out)


def finish(wl: dict[str, Any], reason: str, message: str, now: dt.datetime) -> dict[str, Any]:
    """Condition ``Finished`` True (reason ``Succeeded``, ``Failed`` or ``FailedToStart``): Kueue releases
    the quota and leaves the Workload alone."""
    conds = _set(list(((wl.get("status") or {}).get("conditions")) or []), "Finished", True, reason, message, now,
                 _generation(wl))
    return _status_patch(wl, {"conditions": conds})


def pods_ready(wl: dict[str, Any], ready: bool, now: dt.datetime) -> dict[str, Any] | None:
    """Condition ``PodsReady`` as Kueue's job reconciler reports it (``generatePodsReadyCondition``; Kueue's
    ``waitForPodsReady`` evicts a Workload whose pods do not get ready in time): True ``Started`` (or
    ``Recovered`` after a failure), False ``WaitForStart`` or ``WaitForRecovery``. None when unchanged."""
    current = _cond(wl, "PodsReady")
    if ready and admitted(wl):
        recovering = current is not None and current.get("reason") in ("WaitForRecovery", "Recovered")
        want = (True, "Recovered" if recovering else "Started",
                "All pods reached readiness and the workload is running")
    elif admitted(wl) and current is not None and (current.get("status") == "True"
                                                    or current.get("reason") == "WaitForRecovery"):
        want = (False, "WaitForRecovery", "At least one pod has failed, waiting for recovery")
    else:
        want = (False, "WaitForStart", "Not all pods are ready or succeeded")
    if current is not None and (current.get("status") == "True") == want[0] and current.get("reason") == want[1]:
        return None
    conds = _set(list(((wl.get("status") or {}).get("conditions")) or []), "PodsReady", *want, now, _generation(wl))
    return _status_patch(wl, {"conditions": conds})


# ------------------------------------------------------------------------------------------- the decision


@dataclass
class KueueView:
    """What the adapter read for a queued job: its Workload (None: none yet), the ResourceFlavors its
    admission names, the resolved priority, and what could not be read (shown on the job, retried)."""
    workload: dict[str, Any] | None = None
    flavors: dict[str, dict[str, Any]] = field(default_factory=dict)
    priority: int | None = None
    problem: str | None = None


@dataclass
class KueueStep:
    """The Kueue part of a reconcile plan. ``hold`` (reason, message): no pod may run; ``info``: the
    admission's placement when pods may run."""
    name: str = ""  # the job's Workload
    hold: tuple[str, str] | None = None
    info: PodSetInfo | None = None
    create: dict[str, Any] | None = None
    delete: str | None = None  # name of a Workload to delete (out of date; a new one is queued next pass)
    spec_patch: dict[str, Any] | None = None
    status_patch: dict[str, Any] | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)


def step(job: dict[str, Any], pod: dict[str, Any], replicas: int, suspend: bool, view: KueueView,
         pods_active: bool, now: dt.datetime, ready: bool = False) -> KueueStep:
    """The decision of one pass for a queued job that has not ended (see ``finished`` for one that has).
    ``pod`` is the desired rank-0 pod before admission, ``pods_active`` whether any pod of the job is still
    present and not finished (the quota is released only after they are gone), ``ready`` whether every rank
    of the current gang is ready or has succeeded."""
    out = _step(job, pod, replicas, suspend, view, pods_active, now)
    wl = view.workload
    if out.status_patch is None and wl is not None and not wl["metadata"].get("deletionTimestamp") \
            and not is_true(wl, "Finished"):
        out.status_patch = pods_ready(wl, ready and out.info is not None, now)
    return out


def _step(job: dict[str, Any], pod: dict[str, Any], replicas: int, suspend: bool, view: KueueView,
          pods_active: bool, now: dt.datetime) -> KueueStep:
    queue = queue_name(job) or ""
    name = workload_name(job)
    ref = priority_ref(job)
    out = KueueStep(name=name)
    if view.problem:
        out.hold = ("KueueUnavailable", view.problem)
        return out
    if ref is not None and view.priority is None:
        kind = "WorkloadPriorityClass" if ref.source == SOURCE_WORKLOAD_PRIORITY else "PriorityClass"
        out.hold = ("KueueUnavailable", f"{kind} {ref.name} not found: the Workload's priority is unknown")
        return out
    desired = build_workload(job, pod, replicas, active=not suspend,
                             priority=(ref, view.priority) if ref is not None and view.priority is not None else None)
    wl = view.workload
    if wl is None:
        out.create = desired
        out.hold = ("WaitingForAdmission", f"Workload {name} submitted to LocalQueue {queue}; waiting for Kueue "
                                           f"to admit it")
        out.events.append(("Normal", "CreatedWorkload", f"created Workload {name} in LocalQueue {queue}"))
        return out
    if wl["metadata"].get("deletionTimestamp"):
        out.hold = ("WaitingForAdmission", f"Workload {name} is being deleted; a new one is queued once it is gone")
        return out
    if is_true(wl, "Finished"):
        cond = _cond(wl, "Finished") or {}
        out.hold = ("WorkloadFinished", f"Workload {name} is finished ({cond.get('reason')}: {cond.get('message')}); "
                                        f"delete it to queue the job again")
        return out
    if objects.annotation(wl, ANNOTATION_PODSETS) != objects.annotation(desired, ANNOTATION_PODSETS):
        out.hold = ("WorkloadChanged", f"the job's queue, pod set or priority changed; Workload {name} is replaced "
                                       f"and queued again")
        if not pods_active:
            out.delete = name
            out.events.append(("Normal", "WorkloadChanged", out.hold[1]))
        return out
    if bool((wl.get("spec") or {}).get("active", True)) == suspend:
        out.spec_patch = {"spec": {"active": not suspend}}
    evicted = _cond(wl, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        out.hold = ("Evicted", f"Kueue evicted Workload {name} ({evicted.get('reason')}: {evicted.get('message')}); "
                               f"pods stopped, the job resumes from its last checkpoint when admitted again")
        if has_quota(wl) and not pods_active:
            out.status_patch = release(wl, now)
        return out
    if not admitted(wl):
        reserved = _cond(wl, "QuotaReserved") or {}
        detail = f": {reserved['message']}" if reserved.get("status") != "True" and reserved.get("message") else ""
        out.hold = ("WaitingForAdmission", f"Workload {name} is waiting in LocalQueue {queue}{detail}")
        return out
    try:
        info = podset_info(wl, view.flavors)
        inject(pod, info)
    except AdmissionProblem as exc:
        out.hold = ("AdmissionFailed", str(exc))
        if exc.permanent:
            out.status_patch = finish(wl, FAILED_TO_START, str(exc), now)
            out.events.append(("Warning", "AdmissionFailed", str(exc)))
        return out
    out.info = info
    return out


def finished(view: KueueView, state: str, message: str, now: dt.datetime) -> KueueStep:
    """A job that has ended (``state`` Succeeded or Failed): its Workload, if any, is marked Finished."""
    wl = view.workload
    out = KueueStep(name=wl["metadata"]["name"] if wl is not None else "")
    if wl is not None and not is_true(wl, "Finished") and not wl["metadata"].get("deletionTimestamp"):
        out.status_patch = finish(wl, "Succeeded" if state == "Succeeded" else "Failed", message, now)
    return out


# ---------------------------------------------------------------------------------------------- adapter


def _path(plural: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    out = f"/apis/{API_VERSION}" + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


async def _get(client: KubeClient, url: str) -> dict[str, Any] | None:
    from grstack.operator.kube import ApiError

    try:
        return await client.request("GET", url)
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def observe(client: KubeClient, job: dict[str, Any]) -> KueueView | None:
    """Reads what ``step`` needs for a queued job; None for a job that is not queued. A read the API server
    refuses (RBAC, say) becomes the view's problem, shown on the job."""
    from grstack.operator.kube import ApiError

    if not queue_name(job):
        return None
    view = KueueView()
    namespace = job["metadata"]["namespace"]
    url = _path(WORKLOAD_PLURAL, namespace, workload_name(job))
    try:
        view.workload = await _get(client, url)
        if view.workload is None and await _get(client, f"/apis/{API_VERSION}") is None:
            view.problem = (f"the job names a Kueue LocalQueue, but this cluster serves no {API_VERSION} "
                            f"Workload (is Kueue installed?)")
            return view
        for flavor in flavor_names(view.workload):
            url = _path(FLAVOR_PLURAL, name=flavor)
            found = await _get(client, url)
            if found is not None:
                view.flavors[flavor] = found
        ref = priority_ref(job)
        if ref is not None:
            url = (_path(PRIORITY_CLASS_PLURAL, name=ref.name) if ref.source == SOURCE_WORKLOAD_PRIORITY
                   else f"/apis/scheduling.k8s.io/v1/priorityclasses/{ref.name}")
            found = await _get(client, url)
            if found is not None and isinstance(found.get("value"), int):
                view.priority = found["value"]
    except ApiError as exc:
        view.problem = f"cannot read {url}: {exc}"
    return view


async def apply(client: KubeClient, namespace: str, plan: KueueStep) -> tuple[str, dict[str, Any], Any] | None:
    """Carries out a step: create (409 tolerated), delete, spec and status patches. Returns the first refused
    write as (operation, object, ApiError) for the job's refusal condition, or None. A patch answered 409
    (Kueue wrote first) or 404 is left to the next pass, which decides again on what it reads then."""
    from grstack.operator.kube import ApiError

    target = {"apiVersion": API_VERSION, "kind": WORKLOAD_KIND, "metadata": {"name": plan.name,
                                                                           "namespace": namespace}}
    if plan.create is not None:
        try:
            await client.request("POST", _path(WORKLOAD_PLURAL, namespace), plan.create)
        except ApiError as exc:
            if exc.status != 409:
                return "create", plan.create, exc
    if plan.delete is not None:
        try:
            await client.request("DELETE", _path(WORKLOAD_PLURAL, namespace, plan.delete),
                                 {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                return "delete", target, exc
    for body, sub in ((plan.spec_patch, None), (plan.status_patch, "status")):
        if body is None:
            continue
        try:
            await client.request("PATCH", _path(WORKLOAD_PLURAL, namespace, plan.name, sub), body,
                                 content_type="application/merge-patch+json")
        except ApiError as exc:
            if exc.status not in (404, 409):
                return "patch", target, exc
    return None

"""Pure reconcile of a GRTrainingJob: (job, observed pods, now) -> desired children, pod actions, new status.

No I/O and no clock: the kopf handlers feed in what they observed and apply the plan, so every rule below is
tested with tables (``tests/operator/test_op_training.py``).

Lifecycle (Kubeflow PyTorchJob semantics for a gang of ranks):

- one Pod per rank (``restartPolicy: Never``), labelled with the *attempt* (= ``status.restarts``); a
  headless Service gives rank 0 a stable DNS name for ``MASTER_ADDR``;
- rank 0 Succeeded -> Succeeded; a worker Failed -> the whole gang is deleted and recreated as the next
  attempt, which resumes from the last checkpoint on the checkpoint volume, until ``backoffLimit``;
  exit status 2 is the trainer's "user error" and fails the job at once (retrying cannot help);
- ``activeDeadlineSeconds`` fails a job that runs too long, ``ttlSecondsAfterFinished`` deletes a finished
  job, ``cleanPodPolicy`` says which pods go when it ends, ``suspend`` deletes the pods and resuming
  recreates them (from the checkpoint);
- a spec the models (or the trainer config model) reject -> Failed with reason ``InvalidSpec``.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from grstack.operator import names, objects, trainconfig
from grstack.operator.models import RESERVED_WORKER_ENV, GRTrainingJobSpec

# Gang scheduling (``spec.runPolicy.schedulingPolicy``).
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"  # the scheduler-plugins chart's second scheduler
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"
# Container waiting reasons that will not resolve by waiting (surfaced as condition WorkersWaiting).
BLOCKING_REASONS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
                    "CreateContainerError", "InvalidImageName")

TERMINAL = ("Succeeded", "Failed")
STATE_CONDITIONS = ("Running", "Restarting", "Succeeded", "Failed", "Suspended")
USER_ERROR_EXIT = 2


@dataclass
class TrainingPlan:
    status: dict[str, Any]
    children: list[dict[str, Any]] = field(default_factory=list)  # created when missing
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


class InvalidSpec(ValueError):
    pass


def parse_spec(job: dict[str, Any]) -> GRTrainingJobSpec:
    """The validated spec, or InvalidSpec with a one-line message naming the field."""
    name = job["metadata"]["name"]
    if len(name) > names.MAX_NAME_LENGTH:
        raise InvalidSpec(f"metadata.name: at most {names.MAX_NAME_LENGTH} characters (pod and service names "
                          f"are derived from it)")
    try:
        spec = GRTrainingJobSpec.model_validate(job.get("spec") or {})
    except ValidationError as exc:
        raise InvalidSpec(objects.validation_message(exc)) from None
    problem = _config_problem(trainconfig.config_text(spec), tuple(trainconfig.overrides(spec)))
    if problem:
        raise InvalidSpec(problem)
    return spec


@functools.lru_cache(maxsize=256)
def _config_problem(text: str, overrides: tuple[str, ...]) -> str | None:
    try:
        trainconfig.validate(text, list(overrides))
    except ValueError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------- children


def labels(job: str, component: str = "worker") -> dict[str, str]:
    return {
        names.LABEL_NAME: "grstack",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_COMPONENT: component,
        names.LABEL_JOB: job,
    }


def children(job: dict[str, Any], spec: GRTrainingJobSpec) -> list[dict[str, Any]]:
    """ConfigMap (trainer config), headless Service, and the ServiceAccount/Role/RoleBinding of the workers."""
    name = job["metadata"]["name"]
    base = labels(name)
    config = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": objects.metadata(job, names.job_config_name(name), base),
        "data": {names.CONFIG_KEY: trainconfig.config_text(spec)},
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": objects.metadata(job, names.workers_service_name(name), base),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # rank 0 must resolve before any rank is ready
            "selector": {names.LABEL_JOB: name, names.LABEL_COMPONENT: "worker"},
            "ports": [{"name": "dist", "port": names.MASTER_PORT, "targetPort": names.MASTER_PORT}],
        },
    }
    rbac = objects.self_patch_role(job, names.job_account_name(name), base, [names.worker_pod_name(name, 0)])
    return [config, service, *rbac, *pod_groups(job, spec)]


def pod_groups(job: dict[str, Any], spec: GRTrainingJobSpec) -> list[dict[str, Any]]:
    """The PodGroup of the gang scheduler chosen in ``runPolicy.schedulingPolicy`` (minMember = replicas)."""
    policy = spec.run_policy.scheduling_policy
    name = job["metadata"]["name"]
    if policy.gang_scheduler == "Coscheduling":
        group_spec: dict[str, Any] = {"minMember": spec.workers.replicas}
        if policy.schedule_timeout_seconds is not None:
            group_spec["scheduleTimeoutSeconds"] = policy.schedule_timeout_seconds
        api = COSCHEDULING_API
    elif policy.gang_scheduler == "Volcano":
        group_spec = {"minMember": spec.workers.replicas}
        if policy.queue:
            group_spec["queue"] = policy.queue
        api = VOLCANO_API
    else:
        return []
    return [{"apiVersion": api, "kind": "PodGroup", "metadata": objects.metadata(job, name, labels(name)),
             "spec": group_spec}]


def kueue_queue(job: dict[str, Any], spec: GRTrainingJobSpec) -> str | None:
    return (spec.run_policy.scheduling_policy.kueue_queue_name
            or (job["metadata"].get("labels") or {}).get(KUEUE_QUEUE_LABEL))


def run_dir(name: str, spec: GRTrainingJobSpec) -> str:
    return f"{spec.checkpoint.mount_path.rstrip('/')}/{name}"


def worker_pod(job: dict[str, Any], spec: GRTrainingJobSpec, rank: int, attempt: int) -> dict[str, Any]:
    name = job["metadata"]["name"]
    pod_name = names.worker_pod_name(name, rank)
    pod_labels = {**labels(name), names.LABEL_RANK: str(rank), names.LABEL_ATTEMPT: str(attempt)}
    nproc = spec.workers.nproc_per_node
    args = ["train", "--config", f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}", "--out", run_dir(name, spec),
            "--no-progress"]
    if nproc > 1:  # the trainer starts nproc local ranks RANK = NODE_RANK * nproc + LOCAL_RANK
        args += ["--nproc", str(nproc)]
    for item in trainconfig.overrides(spec):
        args += ["--set", item]
    # torchrun's contract for the pod (its local rank 0): the global RANK of its first rank, the pod's index
    # as NODE_RANK/GROUP_RANK, WORLD_SIZE = all ranks of all pods.
    env = [
        {"name": "MASTER_ADDR", "value": f"{names.worker_pod_name(name, 0)}.{names.workers_service_name(name)}"},
        {"name": "MASTER_PORT", "value": str(names.MASTER_PORT)},
        {"name": "WORLD_SIZE", "value": str(spec.workers.replicas * nproc)},
        {"name": "RANK", "value": str(rank * nproc)},
        {"name": "NODE_RANK", "value": str(rank)},
        {"name": "GROUP_RANK", "value": str(rank)},
        {"name": "LOCAL_RANK", "value": "0"},
        {"name": "LOCAL_WORLD_SIZE", "value": str(nproc)},
        objects.field_env("GRSTACK_POD_NAME", "metadata.name"),
        objects.field_env("GRSTACK_POD_NAMESPACE", "metadata.namespace"),
        *objects.SCRATCH_ENV,
    ]
    if rank == 0:
        env += [{"name": "GRSTACK_PROGRESS_ANNOTATION", "value": names.ANNOTATION_PROGRESS},
                {"name": "GRSTACK_PROGRESS_INTERVAL", "value": str(spec.progress_interval_seconds)}]
    env = _merge_named(env, [e.model_dump(by_alias=True, exclude_none=True) for e in spec.workers.env])

    volumes, mounts = objects.scratch_volumes()
    volumes.append({"name": "config", "configMap": {"name": names.job_config_name(name)}})
    mounts.append({"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True})
    ckpt = spec.checkpoint
    volumes.append({"name": "checkpoint", "persistentVolumeClaim": {"claimName": ckpt.claim_name}}
                   if ckpt.claim_name else {"name": "checkpoint", "emptyDir": {}})
    mounts.append({"name": "checkpoint", "mountPath": ckpt.mount_path})
    if spec.data.claim_name:
        volumes.append({"name": "data",
                        "persistentVolumeClaim": {"claimName": spec.data.claim_name, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": spec.data.mount_path, "readOnly": True})

    container: dict[str, Any] = {
        "name": "trainer",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["grstack"],
        "args": args,
        "env": env,
        "ports": [{"name": "dist", "containerPort": names.MASTER_PORT}],
        "volumeMounts": mounts,
        "securityContext": objects.container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.workers.env_from:
        container["envFrom"] = [dict(e) for e in spec.workers.env_from]
    res = objects.resources(spec.workers.resources, spec.workers.accelerator, count=nproc)
    if res:
        container["resources"] = res
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": pod_name,
        "subdomain": names.workers_service_name(name),
        "serviceAccountName": names.job_account_name(name),
        "automountServiceAccountToken": rank == 0,  # only rank 0 talks to the API server
        "enableServiceLinks": False,
        "securityContext": objects.pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = objects.pull_secrets(spec.image_pull_secrets)
    objects.apply_scheduling(pod_spec, spec.scheduling)
    annotations: dict[str, str] = {}
    template = spec.workers.template
    overlay(pod_spec, template.spec)
    pod_labels = {**template.metadata.labels, **pod_labels}  # the operator's labels win
    annotations.update(template.metadata.annotations)
    gang = spec.run_policy.scheduling_policy.gang_scheduler
    if gang == "Coscheduling":
        pod_labels[COSCHEDULING_LABEL] = name
        pod_spec.setdefault("schedulerName", COSCHEDULING_SCHEDULER)
    elif gang == "Volcano":
        annotations[VOLCANO_ANNOTATION] = name
        pod_spec.setdefault("schedulerName", "volcano")
    queue = kueue_queue(job, spec)
    if queue:  # Kueue's plain-pod-group integration admits the gang as one workload
        pod_labels[KUEUE_QUEUE_LABEL] = queue
        pod_labels[KUEUE_GROUP_LABEL] = f"{name}-a{attempt}"
        annotations[KUEUE_GROUP_COUNT] = str(spec.workers.replicas)
    # The hash covers what the pod runs: its spec, labels and annotations, and the trainer config it mounts. A pod of the current
    # attempt whose hash differs from the desired one was made from an older spec (see reconcile_training).
    digest = spec_hash({"spec": pod_spec, "labels": pod_labels, "annotations": annotations},
                       trainconfig.config_text(spec))
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": objects.metadata(job, pod_name, pod_labels, {
            **annotations, ANNOTATION_SPEC_HASH: digest,
            ANNOTATION_GENERATION: str(job["metadata"].get("generation") or 0)}),
        "spec": pod_spec,
    }


def _merge_named(base: list[dict[str, Any]], extra: list[dict[str, Any]], key: str = "name") -> list[dict[str, Any]]:
    """Lists merged by ``key`` (env by name, volumes by name, mounts by mountPath): ``extra`` replaces an item
    of ``base`` with the same key in place, the rest is appended in order."""
    out = [dict(item) for item in base]
    index = {item.get(key): i for i, item in enumerate(out)}
    for item in extra:
        if item.get(key) in index:
            out[index[item.get(key)]] = dict(item)
        else:
            index[item.get(key)] = len(out)
            out.append(dict(item))
    return out


def _deep_merge(base: Any, extra: Any) -> Any:
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for k, v in extra.items():
            out[k] = _deep_merge(base.get(k), v) if k in base else v
        return out
    return extra


# List fields of a PodSpec / Container merged by key rather than replaced (strategic-merge-patch keys).
_POD_LISTS = {"volumes": "name", "initContainers": "name", "imagePullSecrets": "name", "hostAliases": "ip",
              "topologySpreadConstraints": "topologyKey", "resourceClaims": "name"}
_CONTAINER_LISTS = {"env": "name", "envFrom": None, "volumeMounts": "mountPath", "ports": "containerPort",
                    "volumeDevices": "devicePath"}


def _merge_container(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if k in _CONTAINER_LISTS and isinstance(v, list):
            key = _CONTAINER_LISTS[k]
            out[k] = list(base.get(k) or []) + list(v) if key is None else _merge_named(base.get(k) or [], v, key)
        elif k in base:
            out[k] = _deep_merge(base[k], v)
        else:
            out[k] = v
    if "env" in extra:  # the operator's environment stays authoritative (the models refuse to set it)
        mine = {e["name"]: e for e in base.get("env") or []}
        out["env"] = [mine.get(e["name"], e) if e["name"] in RESERVED_WORKER_ENV else e for e in out["env"]]
    return out


def overlay(pod_spec: dict[str, Any], template: dict[str, Any]) -> None:
    """Merges ``spec.workers.template.spec`` into a worker's pod spec, strategic-merge style: containers and
    the other keyed lists by their key (the ``trainer`` container is the operator's: its env, mounts, ports
    merged, other fields deep-merged), tolerations appended, maps deep-merged, other fields replaced. What the
    operator must own (rank env, command, restartPolicy, its volumes) is refused by the models before this."""
    for key, value in template.items():
        if key == "containers" and isinstance(value, list):
            containers = list(pod_spec["containers"])
            for extra in value:
                names_ = [c["name"] for c in containers]
                if extra.get("name") in names_:
                    i = names_.index(extra["name"])
                    containers[i] = _merge_container(containers[i], extra)
                else:
                    containers.append(dict(extra))  # a sidecar
            pod_spec["containers"] = containers
        elif key in _POD_LISTS and isinstance(value, list):
            pod_spec[key] = _merge_named(pod_spec.get(key) or [], value, _POD_LISTS[key])
        elif key == "tolerations" and isinstance(value, list):
            pod_spec[key] = list(pod_spec.get(key) or []) + list(value)
        elif key in pod_spec:
            pod_spec[key] = _deep_merge(pod_spec[key], value)
        else:
            pod_spec[key] = value


ANNOTATION_SPEC_HASH = f"{names.GROUP}/spec-hash"
ANNOTATION_GENERATION = f"{names.GROUP}/generation"  # the job's metadata.generation the pod was made from


def spec_hash(pod_spec: dict[str, Any], config: str) -> str:
    text = json.dumps({"pod": pod_spec, "config": config}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _changed(desired: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """Names of the pod fields that differ between a desired pod and a live one, for the restart message."""
    out = []
    d_spec, l_spec = desired["spec"], live.get("spec") or {}
    d_main = d_spec["containers"][0]
    l_main: dict[str, Any] = next(iter(l_spec.get("containers") or []), {})
    for key in sorted(d_main):
        if not objects.covers(d_main[key], l_main.get(key)):
            out.append(f"container {key}")
    for key in sorted(d_spec):
        if key != "containers" and not objects.covers(d_spec[key], l_spec.get(key)):
            out.append(key)
    return out or ["trainer config"]


# ------------------------------------------------------------------------------------------------ status


def progress_from(pod: dict[str, Any] | None, previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """Rank 0's report (annotation JSON) in status form; the previous one when there is nothing newer."""
    raw = ((pod or {}).get("metadata", {}).get("annotations") or {}).get(names.ANNOTATION_PROGRESS)
    if not raw:
        return previous
    try:
        report = json.loads(raw)
    except ValueError:
        return previous
    if not isinstance(report, dict):
        return previous
    out: dict[str, Any] = dict(previous or {})
    mapping = {"step": ("step", int), "total_steps": ("totalSteps", int), "epoch": ("epoch", int),
               "loss": ("loss", float), "samples_per_second": ("samplesPerSecond", float),
               "tokens_per_second": ("tokensPerSecond", float), "last_checkpoint": ("lastCheckpoint", str),
               "time": ("updateTime", str)}
    for key, (target, kind) in mapping.items():
        if report.get(key) is not None:
            try:
                out[target] = kind(report[key])
            except (TypeError, ValueError):
                continue
    metrics = report.get("metrics")
    if isinstance(metrics, dict):
        out["metrics"] = {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    step, total = out.get("step"), out.get("totalSteps")
    if step is not None and total:
        out["summary"] = f"{min(100, 100 * step // total)}% ({step}/{total})"
    elif step is not None:
        out["summary"] = f"step {step}"
    return out


def _set_state(status: dict[str, Any], state: str, reason: str, message: str, now: dt.datetime,
               generation: int | None) -> None:
    conds = status.get("conditions") or []
    if state in STATE_CONDITIONS:
        conds = objects.set_condition(conds, state, True, reason, message, now, generation)
    for other in STATE_CONDITIONS:
        if other != state:
            current = objects.condition(conds, other)
            if current is not None and current.get("status") == "True":
                conds = objects.set_condition(conds, other, False, reason, message, now, generation)
    status["conditions"] = conds
    status["state"] = state


def _counts(pods: list[dict[str, Any]]) -> dict[str, int]:
    phases = [objects.phase(p) for p in pods]
    return {"active": sum(p in ("Pending", "Running") for p in phases),
            "succeeded": phases.count("Succeeded"), "failed": phases.count("Failed")}


def _cleanup(pods: list[dict[str, Any]], policy: str, failed: bool) -> list[str]:
    """Pods to delete when the job has ended. A failed gang's survivors would wait forever: always go."""
    out = []
    for pod in pods:
        running = objects.phase(pod) in ("Pending", "Running")
        if policy == "All" or (running and (policy == "Running" or failed)):
            out.append(pod["metadata"]["name"])
    return out


def _failure_message(pod: dict[str, Any]) -> tuple[int | None, str]:
    term = objects.terminated(pod) or {}
    code = term.get("exitCode")
    detail = (term.get("message") or "").strip().splitlines()
    text = f"pod {pod['metadata']['name']} failed"
    if code is not None:
        text += f" with exit status {code}"
    if term.get("reason"):
        text += f" ({term['reason']})"
    if detail:
        text += f": {detail[-1][:300]}"
    return code, text


def reconcile_training(job: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime) -> TrainingPlan:
    meta = job["metadata"]
    name, generation = meta["name"], meta.get("generation")
    status: dict[str, Any] = json.loads(json.dumps(job.get("status") or {}))
    status.setdefault("restarts", 0)
    status["observedGeneration"] = generation
    previous_state = status.get("state")
    plan = TrainingPlan(status=status)
    live = [p for p in pods if not objects.terminating(p)]

    if not objects.condition(status.get("conditions") or [], "Created"):
        status["conditions"] = objects.set_condition(status.get("conditions") or [], "Created", True,
                                                     "JobCreated", f"GRTrainingJob {name} created", now,
                                                     generation)
        status["state"] = previous_state = previous_state or "Created"

    try:
        spec = parse_spec(job)
    except InvalidSpec as exc:
        if previous_state not in TERMINAL:
            _set_state(status, "Failed", "InvalidSpec", str(exc), now, generation)
            status.setdefault("completionTime", objects.timestamp(now))
            plan.events.append(("Warning", "InvalidSpec", str(exc)))
        plan.delete_pods = _cleanup(live, "Running", failed=True)
        return plan

    policy = spec.run_policy
    status["workers"] = _counts([p for p in live if objects.label_int(p, names.LABEL_ATTEMPT) == status["restarts"]])
    rank0 = next((p for p in pods if objects.label_int(p, names.LABEL_RANK) == 0
                  and objects.label_int(p, names.LABEL_ATTEMPT) == status["restarts"]), None)
    progress = progress_from(rank0, status.get("progress"))
    if progress is not None:
        status["progress"] = progress

    if previous_state in TERMINAL:
        _finish(plan, live, spec, now, failed=previous_state == "Failed")
        return plan

    plan.children = children(job, spec)

    if policy.suspend:
        if previous_state != "Suspended":
            _set_state(status, "Suspended", "JobSuspended", "runPolicy.suspend is true; pods deleted", now,
                       generation)
            plan.events.append(("Normal", "Suspended", "job suspended"))
        plan.delete_pods = [p["metadata"]["name"] for p in live]
        status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}
        status.pop("gangAttempt", None)  # the gang is gone on purpose: its absence is no lost worker
        status.pop("gangStartTime", None)
        _waiting_condition(plan, status, {}, now, generation)  # no pods, nothing waits
        return plan
    if previous_state == "Suspended":
        status.pop("startTime", None)  # the deadline counts from the resume, as in Kubeflow
        status.pop("gangAttempt", None)  # the resumed gang has not been seen whole yet
        status["conditions"] = objects.set_condition(status["conditions"], "Suspended", False, "JobResumed",
                                                     "runPolicy.suspend is false; pods recreated", now,
                                                     generation)
        status["state"] = "Created"
        plan.events.append(("Normal", "Resumed", "job resumed from the last checkpoint"))

    start = objects.parse_time(status.get("startTime"))
    if start is not None and policy.active_deadline_seconds is not None:
        deadline = start + dt.timedelta(seconds=policy.active_deadline_seconds)
        if now >= deadline:
            msg = f"job ran longer than activeDeadlineSeconds={policy.active_deadline_seconds}"
            _set_state(status, "Failed", "DeadlineExceeded", msg, now, generation)
            status["completionTime"] = objects.timestamp(now)
            plan.events.append(("Warning", "DeadlineExceeded", msg))
            _finish(plan, live, spec, now, failed=True)
            return plan
        plan.requeue_after = (deadline - now).total_seconds()

    attempt = status["restarts"]
    replicas = spec.workers.replicas
    current: dict[int, dict[str, Any]] = {}
    stale: list[dict[str, Any]] = []
    for pod in live:
        rank = objects.label_int(pod, names.LABEL_RANK)
        if objects.label_int(pod, names.LABEL_ATTEMPT) == attempt and 0 <= rank < replicas and rank not in current:
            current[rank] = pod
        else:
            stale.append(pod)
    plan.delete_pods = [p["metadata"]["name"] for p in stale]

    failed = [current[r] for r in sorted(current) if objects.phase(current[r]) == "Failed"]
    if 0 in current and objects.phase(current[0]) == "Succeeded":
        step = (status.get("progress") or {}).get("step")
        msg = f"rank 0 finished{f' at step {step}' if step is not None else ''}"
        _set_state(status, "Succeeded", "JobSucceeded", msg, now, generation)
        status["completionTime"] = objects.timestamp(now)
        plan.events.append(("Normal", "Succeeded", msg))
        _finish(plan, live, spec, now, failed=False)
        return plan

    # A spec change that reaches the pods (image, env, resources, trainer config, replicas, ...): the gang is
    # restarted on purpose from the last checkpoint, as one gang of the new spec. Not a failure: backoffLimit
    # is not charged. (workers.replicas can only change while suspended or finished: a CEL rule in the CRD.)
    # Only a change of the job's spec counts (its generation moved since the pod was made): a new operator
    # version that builds pods a little differently does not restart the jobs already running.
    desired = {r: worker_pod(job, spec, r, attempt) for r in range(replicas)}
    outdated = {r: p for r, p in current.items()
                if objects.annotation(p, ANNOTATION_SPEC_HASH) not in (None, objects.annotation(
                    desired[r], ANNOTATION_SPEC_HASH))
                and objects.annotation(p, ANNOTATION_GENERATION) not in (None, str(generation or 0))}
    if outdated or (current and any(objects.label_int(p, names.LABEL_RANK) >= replicas for p in stale
                                    if objects.label_int(p, names.LABEL_ATTEMPT) == attempt)):
        rank = min(outdated) if outdated else min(current)
        fields = _changed(desired[rank], outdated[rank]) if outdated else ["workers.replicas"]
        msg = (f"spec changed (generation {generation}: {', '.join(fields)}); restarting all {replicas} workers "
               f"from the last checkpoint")
        _set_state(status, "Restarting", "SpecChanged", msg, now, generation)
        plan.events.append(("Normal", "SpecChanged", msg))
        plan.delete_pods += [p["metadata"]["name"] for p in current.values()]
        status.pop("gangAttempt", None)  # the old gang goes on purpose
        status.pop("gangStartTime", None)
        status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}
        plan.requeue_after = min(plan.requeue_after or 1.0, 1.0)
        return plan

    # A rank that vanished (deleted, evicted) after the whole gang of this attempt was seen: its peers cannot
    # go on without it, so that is a gang failure too. Other missing ranks were never created (see below).
    lost = [r for r in range(replicas) if r not in current]
    problem: tuple[int | None, str, str] | None = None  # (exit status, message, reason)
    if failed:
        problem = (*_failure_message(failed[0]), "WorkerFailed")
    elif lost and replicas > 1 and status.get("gangAttempt") == attempt:
        problem = (None, f"pod {names.worker_pod_name(name, lost[0])} disappeared while its peers were running",
                   "WorkerLost")

    if problem is not None:
        code, msg, reason = problem
        if code == USER_ERROR_EXIT:
            _fail(plan, status, "UserError", msg + " (a user error: not retried)", live, spec, now, generation)
        elif attempt < policy.backoff_limit:
            status["restarts"] = attempt + 1
            text = (f"{msg}; restarting all {replicas} workers from the last checkpoint "
                    f"(restart {attempt + 1} of {policy.backoff_limit})")
            _set_state(status, "Restarting", reason, text, now, generation)
            plan.events.append(("Warning", "Restarting", text))
            plan.delete_pods += [p["metadata"]["name"] for p in current.values()]
            status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}
        else:
            text = f"{msg}; backoffLimit={policy.backoff_limit} restarts used"
            _fail(plan, status, "BackoffLimitExceeded", text, live, spec, now, generation)
        return plan

    _waiting_condition(plan, status, current, now, generation)
    timeout = policy.scheduling_policy.schedule_timeout_seconds
    begun = objects.parse_time(status.get("gangStartTime"))
    if timeout is not None and begun is not None and current:
        scheduled = [r for r, p in current.items() if objects.scheduled(p)]
        if len(scheduled) < replicas:
            due = begun + dt.timedelta(seconds=timeout)
            if scheduled and now >= due:  # a partial gang holds its nodes' accelerators: release it
                msg = (f"only {len(scheduled)}/{replicas} workers were scheduled within scheduleTimeoutSeconds="
                       f"{timeout}; the gang is released (pods deleted) and recreated")
                status["conditions"] = objects.set_condition(status["conditions"], "GangScheduled", False,
                                                             "ScheduleTimeout", msg, now, generation)
                plan.events.append(("Warning", "ScheduleTimeout", msg))
                plan.delete_pods += [p["metadata"]["name"] for p in current.values()]
                status.pop("gangAttempt", None)
                status.pop("gangStartTime", None)
                status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}
                plan.requeue_after = min(plan.requeue_after or 1.0, 1.0)
                return plan
            if now < due:
                wait = (due - now).total_seconds()
                plan.requeue_after = min(plan.requeue_after or wait, wait)
        elif objects.condition(status["conditions"], "GangScheduled") is not None:
            status["conditions"] = objects.set_condition(status["conditions"], "GangScheduled", True,
                                                         "GangScheduled", f"{replicas}/{replicas} workers scheduled",
                                                         now, generation)

    if len(current) == replicas:
        status["gangAttempt"] = attempt
    blocked = {p["metadata"]["name"] for p in pods if p not in current.values()}
    waiting = any(names.worker_pod_name(name, r) in blocked for r in lost)
    if not waiting:  # the whole gang at once, once the previous attempt's pods have released the names
        plan.create_pods = [desired[rank] for rank in lost]
    if plan.create_pods:
        status["gangStartTime"] = objects.timestamp(now)
    if plan.create_pods and not status.get("startTime"):
        status["startTime"] = objects.timestamp(now)
        if policy.active_deadline_seconds is not None:
            plan.requeue_after = float(policy.active_deadline_seconds)
    if waiting:
        plan.requeue_after = min(plan.requeue_after or 1.0, 1.0)

    running = sum(objects.phase(p) == "Running" for p in current.values())
    if running == replicas:
        _set_state(status, "Running", "JobRunning", f"{running}/{replicas} workers running", now, generation)
    return plan


def _waiting_condition(plan: TrainingPlan, status: dict[str, Any], current: dict[int, dict[str, Any]],
                       now: dt.datetime, generation: int | None) -> None:
    """Condition WorkersWaiting (and a Warning Event when it changes) for pods stuck on something that waiting
    will not fix: an image that cannot be pulled, a crash-looping sidecar, an unschedulable pod."""
    found = None
    for rank in sorted(current):
        found = objects.blocked(current[rank], BLOCKING_REASONS)
        if found:
            break
    conds = status.get("conditions") or []
    previous = objects.condition(conds, "WorkersWaiting")
    if found:
        reason, message = found
        if previous is None or previous.get("status") != "True" or previous.get("message") != message:
            plan.events.append(("Warning", reason, message))
        status["conditions"] = objects.set_condition(conds, "WorkersWaiting", True, reason, message, now,
                                                     generation)
    elif previous is not None and previous.get("status") == "True":
        status["conditions"] = objects.set_condition(conds, "WorkersWaiting", False, "NotWaiting",
                                                     "no worker is blocked", now, generation)


def _fail(plan: TrainingPlan, status: dict[str, Any], reason: str, message: str, live: list[dict[str, Any]],
          spec: GRTrainingJobSpec, now: dt.datetime, generation: int | None) -> None:
    _set_state(status, "Failed", reason, message, now, generation)
    status["completionTime"] = objects.timestamp(now)
    plan.events.append(("Warning", reason, message))
    _finish(plan, live, spec, now, failed=True)


def _finish(plan: TrainingPlan, live: list[dict[str, Any]], spec: GRTrainingJobSpec, now: dt.datetime,
            failed: bool) -> None:
    """Terminal bookkeeping: clean pods per policy; delete the job once its TTL has passed."""
    plan.create_pods = []
    doomed = set(plan.delete_pods) | set(_cleanup(live, spec.run_policy.clean_pod_policy, failed))
    plan.delete_pods = sorted(doomed)
    ttl = spec.run_policy.ttl_seconds_after_finished
    done = objects.parse_time(plan.status.get("completionTime"))
    if ttl is not None and done is not None:
        due = done + dt.timedelta(seconds=ttl)
        if now >= due:
            plan.delete_job = True
        else:
            plan.requeue_after = (due - now).total_seconds()
    else:
        plan.requeue_after = None

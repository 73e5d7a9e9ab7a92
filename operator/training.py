"""Pure reconcile of a GRTrainingJob: (job, observed pods, now) -> desired children, pod actions, new status.

No I/O and no clock: the kopf handlers feed in what they observed and apply the plan, so every rule below is
tested with tables (``tests/operator/test_op_training.py``).

Lifecycle (Kubeflow PyTorchJob semantics for a gang of ranks):

- one Pod per rank (``restartPolicy: Never``), labelled with the *attempt* (= ``status.restarts`` +
  ``status.disruptions``); a headless Service gives rank 0 a stable DNS name for ``MASTER_ADDR``;
- rank 0 Succeeded -> Succeeded; a worker Failed -> the whole gang is deleted and recreated as the next
  attempt, which resumes from the last checkpoint on the checkpoint volume, until ``backoffLimit``;
  exit status 2 is the trainer's "user error" and fails the job at once (retrying cannot help); a worker
  the cluster took away (``DisruptionTarget``: preemption, eviction, node drain) restarts the gang without
  charging ``backoffLimit``;
- ``activeDeadlineSeconds`` fails a job that runs too long, ``ttlSecondsAfterFinished`` deletes a finished
  job, ``cleanPodPolicy`` says which pods go when it ends, ``suspend`` deletes the pods and resuming
  recreates them (from the checkpoint);
- a spec the models (or the trainer config model) reject -> Failed with reason ``InvalidSpec``.

The pods' creation times (``startTime``, ``gangStartTime``) are written by ``record_created`` once the API
server has created them; a refused write is surfaced by ``refusals``.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from grstack.operator import kueue, names, objects, policy, trainconfig
from grstack.operator.models import RESERVED_WORKER_ENV, GRTrainingJobSpec

# Gang scheduling (``spec.runPolicy.schedulingPolicy``).
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"  # the scheduler-plugins chart's second scheduler
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
# Container waiting reasons that will not resolve by waiting (surfaced as condition WorkersWaiting).
BLOCKING_REASONS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "CreateContainerConfigError",
                    "CreateContainerError", "InvalidImageName")

TERMINAL = ("Succeeded", "Failed")
STATE_CONDITIONS = ("Running", "Restarting", "Succeeded", "Failed", "Suspended")
USER_ERROR_EXIT = 2
# Reasons a queued job is held that need someone to act (Warning Events); the rest are Kueue doing its job.
KUEUE_PROBLEMS = ("KueueUnavailable", "AdmissionFailed", "WorkloadFinished")
# status.reason of a pod the kubelet or scheduler took away (node-pressure eviction, preemption).
DISRUPTION_REASONS = ("Evicted", "Preempted", "Preempting", "Terminated", "NodeShutdown")


@dataclass
class TrainingPlan:
    status: dict[str, Any]
    children: list[dict[str, Any]] = field(default_factory=list)  # created when missing
    create_pods: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    deadline_seconds: int | None = None  # activeDeadlineSeconds, counted once record_created sets startTime
    kueue: kueue.KueueStep | None = None  # a queued job's Workload writes (operator/kueue.py)


class InvalidSpec(ValueError):
    pass


def parse_spec(job: dict[str, Any]) -> GRTrainingJobSpec:
    """The validated spec, or InvalidSpec with a one-line message naming the field."""
    name = job["metadata"]["name"]
    problem = names.name_problem(name)  # the CRD's CEL rules, for API servers that skipped them
    if problem:
        raise InvalidSpec(problem)
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
    operator must own (rank env, command, restartPolicy, its volumes) and what escapes the restricted pod
    security profile (unless the cluster allows it) are refused by the models before this; every container,
    sidecars and init containers included, then gets the restricted securityContext defaults."""
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
    policy.restrict(pod_spec, template)


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


# --------------------------------------------------------------------------------------------- reconcile
#
# reconcile_training dispatches on status.state to one handler per state (HANDLERS). A handler works on a
# Pass (the job, its observed pods, the status being built, the plan) and returns the state to continue with
# in the same pass (a resumed job goes on as Created), or None when the pass is decided. The active states
# share one ordered list of steps (ACTIVE_STEPS): each is a small pure rule that either decides the pass
# (returns True) or leaves it to the next. Pod creation times are not set here: the handlers write them
# after the API server has created the pods (record_created).


def attempt_of(status: dict[str, Any]) -> int:
    """The gang's incarnation (the pods' attempt label): every gang restart, charged or not, starts a new one."""
    return int(status.get("restarts") or 0) + int(status.get("disruptions") or 0)


@dataclass
class Pass:
    """What one pass decides on: the job and its parsed spec, the pods observed, the time, and the plan (whose
    ``status`` is the new status being built)."""

    job: dict[str, Any]
    spec: GRTrainingJobSpec
    pods: list[dict[str, Any]]
    now: dt.datetime
    plan: TrainingPlan
    kueue_view: kueue.KueueView | None = None

    @property
    def status(self) -> dict[str, Any]:
        return self.plan.status

    @property
    def name(self) -> str:
        return str(self.job["metadata"]["name"])

    @property
    def generation(self) -> int | None:
        return self.job["metadata"].get("generation")

    @property
    def replicas(self) -> int:
        return self.spec.workers.replicas

    @functools.cached_property
    def live(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if not objects.terminating(p)]

    @functools.cached_property
    def gang(self) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
        """(rank -> live pod of the current attempt, every other live pod)."""
        attempt = attempt_of(self.status)
        current: dict[int, dict[str, Any]] = {}
        stale: list[dict[str, Any]] = []
        for pod in self.live:
            rank = objects.label_int(pod, names.LABEL_RANK)
            if objects.label_int(pod, names.LABEL_ATTEMPT) == attempt and 0 <= rank < self.replicas \
                    and rank not in current:
                current[rank] = pod
            else:
                stale.append(pod)
        return current, stale

    @property
    def current(self) -> dict[int, dict[str, Any]]:
        return self.gang[0]

    @functools.cached_property
    def gate(self) -> kueue.KueueStep | None:
        """A queued job's Kueue step (None: not queued): whether its pods may run, and with what placement."""
        if not kueue.queue_name(self.job):
            return None
        pod = worker_pod(self.job, self.spec, 0, attempt_of(self.status))
        active = any(objects.phase(x) not in ("Succeeded", "Failed") for x in self.pods)
        ready = sum(objects.ready(x) or objects.phase(x) == "Succeeded"
                    for x in self.current.values()) >= self.replicas
        return kueue.step(self.job, pod, self.replicas, self.spec.run_policy.suspend,
                          self.kueue_view or kueue.KueueView(), active, self.now, ready)

    @functools.cached_property
    def desired(self) -> dict[int, dict[str, Any]]:
        attempt = attempt_of(self.status)
        pods = {r: worker_pod(self.job, self.spec, r, attempt) for r in range(self.replicas)}
        info = self.gate.info if self.gate is not None else None
        return {r: kueue.inject(pod, info) for r, pod in pods.items()} if info is not None else pods

    def state(self, state: str, reason: str, message: str) -> None:
        _set_state(self.status, state, reason, message, self.now, self.generation)

    def condition(self, type_: str, value: bool, reason: str, message: str) -> None:
        self.status["conditions"] = objects.set_condition(self.status.get("conditions") or [], type_, value,
                                                          reason, message, self.now, self.generation)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.plan.events.append((type_, reason, message))

    def requeue(self, seconds: float) -> None:
        self.plan.requeue_after = seconds if self.plan.requeue_after is None else min(self.plan.requeue_after,
                                                                                      seconds)

    def restart_gang(self, reason: str, message: str, event: tuple[str, str] = ("Warning", "Restarting"),
                     requeue_s: float | None = 1.0) -> None:
        """The whole gang restarts from the last checkpoint: state Restarting, an event, the pods dropped
        (and a requeue, unless the pods' own deletion events will bring the next pass)."""
        self.state("Restarting", reason, message)
        self.event(*event, message)
        self.drop_gang()
        if requeue_s is not None:
            self.requeue(requeue_s)

    def drop_gang(self) -> None:
        """The current gang goes on purpose (restart, suspend, release): delete it, forget its start."""
        self.plan.delete_pods += [p["metadata"]["name"] for p in self.current.values()
                                  if p["metadata"]["name"] not in self.plan.delete_pods]
        self.status.pop("gangAttempt", None)
        self.status.pop("gangStartTime", None)
        self.status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}


def reconcile_training(job: dict[str, Any], pods: list[dict[str, Any]], now: dt.datetime,
                       kueue_view: kueue.KueueView | None = None) -> TrainingPlan:
    """The plan for one pass: a pure function of the job, its observed pods, the time and, for a job queued
    in Kueue, what was read of its Workload (None: nothing yet)."""
    meta = job["metadata"]
    name, generation = meta["name"], meta.get("generation")
    status: dict[str, Any] = json.loads(json.dumps(job.get("status") or {}))
    status.setdefault("restarts", 0)
    status["observedGeneration"] = generation
    plan = TrainingPlan(status=status)
    if not objects.condition(status.get("conditions") or [], "Created"):
        status["conditions"] = objects.set_condition(status.get("conditions") or [], "Created", True,
                                                     "JobCreated", f"GRTrainingJob {name} created", now,
                                                     generation)
        status["state"] = status.get("state") or "Created"

    try:
        spec = parse_spec(job)
    except InvalidSpec as exc:
        if status.get("state") not in TERMINAL:
            _set_state(status, "Failed", "InvalidSpec", str(exc), now, generation)
            status.setdefault("completionTime", objects.timestamp(now))
            plan.events.append(("Warning", "InvalidSpec", str(exc)))
        plan.delete_pods = _cleanup([p for p in pods if not objects.terminating(p)], "Running", failed=True)
        if kueue.queue_name(job):
            plan.kueue = kueue.finished(kueue_view or kueue.KueueView(), "Failed", str(exc), now)
        return plan

    p = Pass(job=job, spec=spec, pods=pods, now=now, plan=plan, kueue_view=kueue_view)
    attempt = attempt_of(status)
    status["workers"] = _counts([x for x in p.live if objects.label_int(x, names.LABEL_ATTEMPT) == attempt])
    rank0 = next((x for x in pods if objects.label_int(x, names.LABEL_RANK) == 0
                  and objects.label_int(x, names.LABEL_ATTEMPT) == attempt), None)
    progress = progress_from(rank0, status.get("progress"))
    if progress is not None:
        status["progress"] = progress
    if status["state"] not in TERMINAL:
        plan.children = children(job, spec)

    state: str | None = status["state"]
    for _ in range(len(HANDLERS)):  # a handler hands over at most once per state
        if state is None:
            break
        state = HANDLERS.get(state, _on_active)(p)
    if kueue.queue_name(job):
        _kueue_writes(p)
    return plan


def _kueue_writes(p: Pass) -> None:
    """The Workload writes of the pass: the gate's (create, deactivate, release) while the job runs or waits,
    Finished once it has ended."""
    state = p.status.get("state")
    if state in TERMINAL:
        message = (objects.condition(p.status.get("conditions") or [], state) or {}).get("message") or state
        p.plan.kueue = kueue.finished(p.kueue_view or kueue.KueueView(), state, message, p.now)
    else:
        p.plan.kueue = p.gate
    if p.plan.kueue is not None:
        p.plan.events += p.plan.kueue.events


# ------------------------------------------------------------------------------------------ state handlers


def _on_finished(p: Pass) -> str | None:
    """Succeeded or Failed: only cleanup (cleanPodPolicy) and the TTL remain."""
    _finish(p.plan, p.live, p.spec, p.now, failed=p.status["state"] == "Failed")
    return None


def _on_suspended(p: Pass) -> str | None:
    """Suspended: no pods while runPolicy.suspend holds, or while Kueue has not admitted a queued job;
    resuming (or the admission) goes on as a new gang (from the checkpoint)."""
    if _suspend(p):
        return None
    p.status.pop("startTime", None)  # the deadline counts from the resume, as in Kubeflow
    p.status.pop("gangAttempt", None)  # the resumed gang has not been seen whole yet
    gate = p.gate
    if gate is not None and gate.info is not None:
        p.condition("Suspended", False, "JobResumed", f"Workload {gate.name} admitted by Kueue ClusterQueue "
                    f"{gate.info.cluster_queue}; pods recreated")
    else:
        p.condition("Suspended", False, "JobResumed", "runPolicy.suspend is false; pods recreated")
    p.status["state"] = "Created"
    p.event("Normal", "Resumed", "job resumed from the last checkpoint")
    return "Created"


def _on_active(p: Pass) -> str | None:
    """Created, Running, Restarting: a gang being made, running, or remade. The same rules hold whatever the
    last reported state, in this order."""
    for step in ACTIVE_STEPS:
        if step(p):
            return None
    return None


# --------------------------------------------------------------------------------- steps of active states


def _suspend(p: Pass) -> bool:
    """runPolicy.suspend (the user's pause button), or a queued job Kueue has not admitted (or has evicted):
    delete every pod."""
    if p.spec.run_policy.suspend:
        reason, message = "JobSuspended", "runPolicy.suspend is true; pods deleted"
    elif p.gate is not None and p.gate.hold is not None:
        reason, message = p.gate.hold
    else:
        return False
    held = objects.condition(p.status.get("conditions") or [], "Suspended") or {}
    if p.status.get("state") != "Suspended" or held.get("reason") != reason:
        p.state("Suspended", reason, message)
        if reason == "JobSuspended":
            p.event("Normal", "Suspended", "job suspended")
        else:
            p.event("Warning" if reason in KUEUE_PROBLEMS else "Normal", reason, message)
    elif held.get("message") != message:  # the same wait, Kueue's reason for it updated
        p.condition("Suspended", True, reason, message)
    p.plan.delete_pods = [x["metadata"]["name"] for x in p.live]
    p.status["workers"] = {"active": 0, "succeeded": 0, "failed": 0}
    p.status.pop("gangAttempt", None)  # the gang is gone on purpose: its absence is no lost worker
    p.status.pop("gangStartTime", None)
    _waiting_condition(p.plan, p.status, {}, p.now, p.generation)  # no pods, nothing waits
    return True


def _deadline(p: Pass) -> bool:
    """activeDeadlineSeconds, counted from startTime (the first pod created, or the resume)."""
    policy = p.spec.run_policy
    start = objects.parse_time(p.status.get("startTime"))
    if start is None or policy.active_deadline_seconds is None:
        return False
    deadline = start + dt.timedelta(seconds=policy.active_deadline_seconds)
    if p.now < deadline:
        p.requeue((deadline - p.now).total_seconds())
        return False
    msg = f"job ran longer than activeDeadlineSeconds={policy.active_deadline_seconds}"
    p.plan.requeue_after = None
    _fail(p.plan, p.status, "DeadlineExceeded", msg, p.live, p.spec, p.now, p.generation)
    return True


def _observe(p: Pass) -> bool:
    """Bookkeeping from what exists: pods of other attempts go; a gang created by an earlier pass whose status
    write was lost gets its start times from the pods themselves."""
    current, stale = p.gang
    p.plan.delete_pods = [x["metadata"]["name"] for x in stale]
    if current:
        created = min((x["metadata"].get("creationTimestamp") or objects.timestamp(p.now)) for x in current.values())
        p.status.setdefault("gangStartTime", created)
        p.status.setdefault("startTime", created)
    return False


def _succeeded(p: Pass) -> bool:
    """Rank 0 Succeeded: the job has."""
    rank0 = p.current.get(0)
    if rank0 is None or objects.phase(rank0) != "Succeeded":
        return False
    step = (p.status.get("progress") or {}).get("step")
    msg = f"rank 0 finished{f' at step {step}' if step is not None else ''}"
    p.state("Succeeded", "JobSucceeded", msg)
    p.status["completionTime"] = objects.timestamp(p.now)
    p.event("Normal", "Succeeded", msg)
    _finish(p.plan, p.live, p.spec, p.now, failed=False)
    return True


def _spec_changed(p: Pass) -> bool:
    """A spec change that reaches the pods (image, env, resources, trainer config, replicas, ...): the gang is
    restarted on purpose from the last checkpoint, as one gang of the new spec; backoffLimit is not charged.
    (workers.replicas can only change while suspended or finished: a CEL rule in the CRD.) Only a change of
    the job's spec counts (its generation moved since the pod was made): a new operator version that builds
    pods a little differently does not restart the jobs already running."""
    current, stale = p.gang
    attempt = attempt_of(p.status)
    outdated = {r: x for r, x in current.items()
                if objects.annotation(x, ANNOTATION_SPEC_HASH) not in (None, objects.annotation(
                    p.desired[r], ANNOTATION_SPEC_HASH))
                and objects.annotation(x, ANNOTATION_GENERATION) not in (None, str(p.generation or 0))}
    shrunk = current and any(objects.label_int(x, names.LABEL_RANK) >= p.replicas for x in stale
                             if objects.label_int(x, names.LABEL_ATTEMPT) == attempt)
    if not outdated and not shrunk:
        return False
    rank = min(outdated) if outdated else min(current)
    fields = _changed(p.desired[rank], outdated[rank]) if outdated else ["workers.replicas"]
    msg = (f"spec changed (generation {p.generation}: {', '.join(fields)}); restarting all {p.replicas} workers "
           f"from the last checkpoint")
    p.restart_gang("SpecChanged", msg, event=("Normal", "SpecChanged"))
    return True


def disruption(pod: dict[str, Any]) -> str | None:
    """Why a pod was taken away by the cluster rather than failed (preemption, eviction, node drain, node
    pressure): its DisruptionTarget condition, or the kubelet's Evicted/Preempted reason; None otherwise."""
    st = pod.get("status") or {}
    for cond in st.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            why = str(cond.get("reason") or "DisruptionTarget")
            return f"{why}: {cond['message'][:300]}" if cond.get("message") else why
    if st.get("reason") in DISRUPTION_REASONS:
        return f"{st['reason']}: {st['message'][:300]}" if st.get("message") else str(st["reason"])
    return None


def _failed(p: Pass) -> bool:
    """A worker failed, was disrupted, or vanished after the whole gang was seen: the peers cannot go on
    without it, so the gang restarts from the checkpoint. Exit status 2 (a user error) fails the job; a
    disruption (preemption, eviction, drain) restarts without charging backoffLimit; the rest is charged."""
    attempt = attempt_of(p.status)
    current = p.current
    failed = [current[r] for r in sorted(current) if objects.phase(current[r]) == "Failed"]
    disrupted = [(x, why) for x in p.pods if objects.label_int(x, names.LABEL_ATTEMPT) == attempt
                 and 0 <= objects.label_int(x, names.LABEL_RANK) < p.replicas and (why := disruption(x))]
    user_errors = [x for x in failed if _failure_message(x)[0] == USER_ERROR_EXIT]
    if user_errors:
        msg = _failure_message(user_errors[0])[1]
        _fail(p.plan, p.status, "UserError", msg + " (a user error: not retried)", p.live, p.spec, p.now,
              p.generation)
        return True
    limit = p.spec.run_policy.backoff_limit
    if disrupted:
        pod, why = disrupted[0]
        count = int(p.status.get("disruptions") or 0) + 1
        p.status["disruptions"] = count
        text = (f"pod {pod['metadata']['name']} was disrupted ({why}); restarting all {p.replicas} workers from "
                f"the last checkpoint (disruption {count}: not counted against backoffLimit={limit})")
        p.restart_gang("WorkerDisrupted", text)
        return True
    lost = [r for r in range(p.replicas) if r not in current]
    if failed:
        msg, reason = _failure_message(failed[0])[1], "WorkerFailed"
    elif lost and p.replicas > 1 and p.status.get("gangAttempt") == attempt:
        msg = f"pod {names.worker_pod_name(p.name, lost[0])} disappeared while its peers were running"
        reason = "WorkerLost"
    else:
        return False
    restarts = int(p.status.get("restarts") or 0)
    if restarts >= limit:
        _fail(p.plan, p.status, "BackoffLimitExceeded", f"{msg}; backoffLimit={limit} restarts used", p.live,
              p.spec, p.now, p.generation)
        return True
    p.status["restarts"] = restarts + 1
    text = (f"{msg}; restarting all {p.replicas} workers from the last checkpoint "
            f"(restart {restarts + 1} of {limit})")
    p.restart_gang(reason, text, requeue_s=None)
    return True


def _schedule_timeout(p: Pass) -> bool:
    """WorkersWaiting, and schedulingPolicy.scheduleTimeoutSeconds: a partial gang holding its nodes'
    accelerators past the timeout is released (deleted) and recreated."""
    current = p.current
    _waiting_condition(p.plan, p.status, current, p.now, p.generation)
    timeout = p.spec.run_policy.scheduling_policy.schedule_timeout_seconds
    begun = objects.parse_time(p.status.get("gangStartTime"))
    if timeout is None or begun is None or not current:
        return False
    scheduled = [r for r, x in current.items() if objects.scheduled(x)]
    if len(scheduled) == p.replicas:
        if objects.condition(p.status["conditions"], "GangScheduled") is not None:
            p.condition("GangScheduled", True, "GangScheduled", f"{p.replicas}/{p.replicas} workers scheduled")
        return False
    due = begun + dt.timedelta(seconds=timeout)
    if p.now < due:
        p.requeue((due - p.now).total_seconds())
        return False
    if not scheduled:
        return False
    msg = (f"only {len(scheduled)}/{p.replicas} workers were scheduled within scheduleTimeoutSeconds={timeout}; "
           "the gang is released (pods deleted) and recreated")
    p.condition("GangScheduled", False, "ScheduleTimeout", msg)
    p.event("Warning", "ScheduleTimeout", msg)
    p.drop_gang()
    p.requeue(1.0)
    return True


def _start_gang(p: Pass) -> bool:
    """Creates the missing ranks, the whole gang at once, once the previous attempt's pods have released
    their names (a rank missing after the gang was seen whole is handled by _failed)."""
    current = p.current
    if len(current) == p.replicas:
        p.status["gangAttempt"] = attempt_of(p.status)
    missing = [r for r in range(p.replicas) if r not in current]
    holders = {x["metadata"]["name"] for x in p.pods if x not in current.values()}
    if any(names.worker_pod_name(p.name, r) in holders for r in missing):
        p.requeue(1.0)
        return False
    p.plan.create_pods = [p.desired[r] for r in missing]
    p.plan.deadline_seconds = p.spec.run_policy.active_deadline_seconds
    return False


def _running(p: Pass) -> bool:
    running = sum(objects.phase(x) == "Running" for x in p.current.values())
    if running == p.replicas:
        p.state("Running", "JobRunning", f"{running}/{p.replicas} workers running")
    return True


ACTIVE_STEPS: tuple[Callable[[Pass], bool], ...] = (
    _suspend, _deadline, _observe, _succeeded, _spec_changed, _failed, _schedule_timeout, _start_gang, _running)

HANDLERS: dict[str, Callable[[Pass], str | None]] = {
    "Created": _on_active, "Running": _on_active, "Restarting": _on_active,
    "Suspended": _on_suspended, "Succeeded": _on_finished, "Failed": _on_finished,
}


def record_created(plan: TrainingPlan, created: int, now: dt.datetime) -> None:
    """After the API server created ``created`` of the plan's pods: the gang (and, the first time, the job)
    started now; the deadline counts from here."""
    if not created:
        return
    plan.status["gangStartTime"] = objects.timestamp(now)
    if not plan.status.get("startTime"):
        plan.status["startTime"] = objects.timestamp(now)
        if plan.deadline_seconds is not None:
            wait = float(plan.deadline_seconds)
            plan.requeue_after = wait if plan.requeue_after is None else min(plan.requeue_after, wait)


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

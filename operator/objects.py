"""Small pure helpers shared by both reconcilers: conditions, owner references, pod fields, container bits."""

from __future__ import annotations

import datetime as dt
from typing import Any

from grstack.operator import names, quantity
from grstack.operator.models import EnvVar, Resources, Scheduling

RUN_AS = 1000  # the image's non-root user (see Dockerfile)


def validation_message(exc: Exception) -> str:
    """One line naming each bad field by its wire path (``spec.workers.replicas: ...``)."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return str(exc)
    parts = []
    for err in exc.errors():
        loc = "spec." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "spec"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def timestamp(now: dt.datetime) -> str:
    return now.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str,
                  now: dt.datetime, generation: int | None) -> list[dict[str, Any]]:
    """metav1.Condition semantics: lastTransitionTime changes only when the status flips."""
    value = "True" if status else "False"
    out = []
    found = False
    for cond in conditions:
        if cond.get("type") == type_:
            found = True
            changed = cond.get("status") != value
            cond = {**cond, "status": value, "reason": reason, "message": message,
                    "observedGeneration": generation}
            if changed or not cond.get("lastTransitionTime"):
                cond["lastTransitionTime"] = timestamp(now)
        out.append(cond)
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": timestamp(now), "observedGeneration": generation})
    return out


def condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": owner.get("apiVersion", names.API_VERSION),
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(owner: dict[str, Any], name: str, labels: dict[str, str],
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": dict(labels),
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


# -------------------------------------------------------------------------------------------------- pods


def phase(pod: dict[str, Any]) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def terminating(pod: dict[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return phase(pod) == "Running" and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The terminated state of the first container, if any (exit code, reason, message)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            return state["terminated"]
    return None


def annotation(obj: dict[str, Any], key: str) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(key)


# Fields holding a quantity, and maps of quantities: the API server stores them canonicalised ("0.5" as
# "500m"), so they compare by value.
QUANTITY_FIELDS = ("sizeLimit",)
QUANTITY_MAPS = ("requests", "limits")


def covers(desired: Any, live: Any, _is_quantity: bool = False) -> bool:
    """Whether the live object already has every desired field (the API server adds defaults of its own and
    canonicalises quantities)."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        if _is_quantity:  # a map of quantities (requests, limits)
            return all(v is not None and quantity.equal(v, live.get(k)) for k, v in desired.items())
        return all(covers(v, live.get(k), True) if k in QUANTITY_MAPS else _covers_field(k, v, live.get(k))
                   for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(covers, desired, live))
    return desired == live or (desired is not None and live is not None and str(desired) == str(live))


def _covers_field(key: str, desired: Any, live: Any) -> bool:
    if key in QUANTITY_FIELDS and desired is not None and live is not None:
        return quantity.equal(desired, live)
    return covers(desired, live)


def scheduled(pod: dict[str, Any]) -> bool:
    """Whether the pod is bound to a node (it holds that node's resources)."""
    if (pod.get("spec") or {}).get("nodeName") or phase(pod) != "Pending":
        return True
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in conds)


def blocked(pod: dict[str, Any], reasons: tuple[str, ...]) -> tuple[str, str] | None:
    """(reason, message) when a container of the pod waits for one of ``reasons``, or the pod is
    Unschedulable."""
    name = pod.get("metadata", {}).get("name", "?")
    st = pod.get("status") or {}
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in reasons:
            text = f"pod {name} container {cs.get('name')}: {waiting['reason']}"
            if waiting.get("message"):
                text += f": {waiting['message'][:300]}"
            return waiting["reason"], text
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and \
                cond.get("reason") == "Unschedulable":
            text = f"pod {name} is unschedulable" + (f": {cond['message'][:300]}" if cond.get("message") else "")
            return "Unschedulable", text
    return None


def label_int(pod: dict[str, Any], key: str, default: int = -1) -> int:
    try:
        return int(pod.get("metadata", {}).get("labels", {}).get(key, default))
    except (TypeError, ValueError):
        return default


# ---------------------------------------------------------------------------------------------- containers

ACCELERATOR_RESOURCES = {"nvidia": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}


def resources(spec: Resources, accelerator: str, count: int = 1) -> dict[str, Any]:
    """Container resources: the user's requests/limits plus the accelerator device as an extended resource."""
    out: dict[str, Any] = {}
    requests = dict(spec.requests)
    limits = dict(spec.limits)
    device = ACCELERATOR_RESOURCES.get(accelerator)
    if device:
        limits.setdefault(device, count)
        requests.setdefault(device, limits[device])
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def env_list(items: list[EnvVar]) -> list[dict[str, Any]]:
    return [{"name": e.name, "value": e.value} for e in items]


def field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict[str, Any]:
    """The Pod Security Standards' restricted profile, explicit on each container (and a read-only root)."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


# A read-only root filesystem needs writable scratch space: /tmp (HOME, caches) and /dev/shm (DataLoader
# workers, gloo shared memory).
SCRATCH_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "MPLCONFIGDIR", "value": "/tmp/.config/matplotlib"},
    {"name": "PYTHONUNBUFFERED", "value": "1"},
]


def scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def apply_scheduling(pod_spec: dict[str, Any], scheduling: Scheduling) -> None:
    if scheduling.scheduler_name:
        pod_spec["schedulerName"] = scheduling.scheduler_name
    if scheduling.priority_class_name:
        pod_spec["priorityClassName"] = scheduling.priority_class_name
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in scheduling.tolerations]
    if scheduling.affinity:
        pod_spec["affinity"] = dict(scheduling.affinity)


def pull_secrets(secrets: list[str]) -> list[dict[str, str]]:
    return [{"name": s} for s in secrets]


def self_patch_role(owner: dict[str, Any], name: str, labels: dict[str, str],
                    pod_names: list[str]) -> list[dict[str, Any]]:
    """ServiceAccount + Role + RoleBinding letting the named pods patch themselves (progress/stats reports)."""
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(owner, name, labels),
          "automountServiceAccountToken": False}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": metadata(owner, name, labels),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "resourceNames": list(pod_names),
                   "verbs": ["get", "patch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": metadata(owner, name, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner["metadata"]["namespace"]}],
    }
    return [sa, role, binding]

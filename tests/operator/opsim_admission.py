"""Validating admission of the emulator (``opsim.py``): Pod Security Admission and the ResourceQuota check.

A real API server refuses a pod that breaks the namespace's Pod Security level or its quota with 403
Forbidden; the operator must surface that refusal on its resource. These checks reproduce what the operator's
pods meet, with kube-apiserver's wording:

- Pod Security ``restricted`` (and ``baseline``) enforced in namespaces labelled
  ``pod-security.kubernetes.io/enforce``: host namespaces, privileged, capabilities, hostPath and other
  restricted volume types, hostPorts, allowPrivilegeEscalation, runAsNonRoot, runAsUser=0, seccompProfile;
  the message lists the failed checks in the order of their check IDs, as the PodSecurity plugin does.
  Not emulated: AppArmor, SELinux, procMount, sysctls, Windows host process, ``warn``/``audit`` modes,
  exemptions, pinned versions (every version is ``latest``).
- ResourceQuota: the hard limits ``pods``/``count/pods``, ``requests.*``/``limits.*`` and the bare
  ``cpu``/``memory``/``ephemeral-storage`` (= requests) against the non-terminal pods of the namespace;
  a pod lacking a request or limit a quota constrains is refused (``failed quota: ... must specify``);
  object counts of any kind (``count/deployments.apps``, ``services``, ...). Not emulated: scopes,
  scopeSelector, ``status.used`` bookkeeping.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import kmock
from kubernetes.utils.quantity import parse_quantity

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
LEVELS = ("privileged", "baseline", "restricted")
# Capabilities the baseline level allows to add (the container runtime's defaults).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
_NOT_VOLUME_TYPES = {"name"}


def forbidden(kind_plural: str, name: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=403, reason="Forbidden",
                                 message=f'{kind_plural} "{name}" is forbidden: {message}',
                                 details={"name": name, "kind": kind_plural})


def admit_create(resource: Any, obj: dict[str, Any], namespace_labels: dict[str, str],
                 live_pods: list[dict[str, Any]], quotas: list[dict[str, Any]], same_kind: int = 0) -> None:
    """Raises 403 Forbidden when the new object breaks the namespace's Pod Security level or a quota
    (``same_kind``: how many objects of its resource the namespace holds, for object-count quotas)."""
    name = (obj.get("metadata") or {}).get("name") or (obj.get("metadata") or {}).get("generateName") or ""
    if resource != kmock.resource("v1/pods"):
        counted = group_resource(resource)
        for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
            problem = count_problem(quota, resource, same_kind)
            if problem:
                raise forbidden(counted, name, problem)
        return
    level = namespace_labels.get(ENFORCE_LABEL, "privileged")
    if level in LEVELS[1:]:
        reasons = pod_security_violations(obj, level)
        if reasons:
            raise forbidden("pods", name, f'violates PodSecurity "{level}:latest": ' + ", ".join(reasons))
    for quota in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        problem = quota_problem(quota, obj, live_pods)
        if problem:
            raise forbidden("pods", name, problem)


# ----------------------------------------------------------------------------------------- Pod Security


def _quote(items: list[str]) -> str:
    return ", ".join(f'"{i}"' for i in items)


def _containers_phrase(names: list[str], singular: str = "container", plural: str = "containers") -> str:
    return f"{singular if len(names) == 1 else plural} {_quote(names)}"


def _all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or []),
            *(spec.get("ephemeralContainers") or [])]


def pod_security_violations(pod: dict[str, Any], level: str) -> list[str]:
    """``reason (detail)`` of each failed check, in check-ID order (as the PodSecurity plugin lists them)."""
    spec = pod.get("spec") or {}
    pod_sc = spec.get("securityContext") or {}
    containers = _all_containers(spec)
    restricted = level == "restricted"
    checks: list[tuple[str, str | None]] = []

    def sc(c: dict[str, Any]) -> dict[str, Any]:
        return c.get("securityContext") or {}

    if restricted:  # allowPrivilegeEscalation
        bad = [c["name"] for c in containers if sc(c).get("allowPrivilegeEscalation") is not False]
        checks.append(("allowPrivilegeEscalation != false", bad and (
            f"{_containers_phrase(bad)} must set securityContext.allowPrivilegeEscalation=false")))
    # capabilities: baseline (added beyond the defaults) or restricted (drop ALL, add at most NET_BIND_SERVICE)
    allowed_add = {"NET_BIND_SERVICE"} if restricted else BASELINE_CAPABILITIES
    no_drop = [c["name"] for c in containers
               if "ALL" not in ((sc(c).get("capabilities") or {}).get("drop") or [])]
    adders = [c for c in containers if set((sc(c).get("capabilities") or {}).get("add") or []) - allowed_add]
    added = sorted({a for c in adders for a in (sc(c).get("capabilities") or {}).get("add") or []} - allowed_add)
    details = []
    if restricted and no_drop:
        details.append(f'{_containers_phrase(no_drop)} must set securityContext.capabilities.drop=["ALL"]')
    if adders:
        details.append(f"{_containers_phrase([c['name'] for c in adders])} must not include {_quote(added)} in "
                       "securityContext.capabilities.add")
    checks.append(("unrestricted capabilities" if restricted else "non-default capabilities",
                   "; ".join(details) or None))
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    checks.append(("host namespaces", ", ".join(hosts) or None))
    volumes = spec.get("volumes") or []
    if not restricted:  # restricted's volume check covers hostPath
        host_paths = [v["name"] for v in volumes if "hostPath" in v]
        checks.append(("hostPath volumes", host_paths and _containers_phrase(host_paths, "volume", "volumes")))
    ports = [(c["name"], p["hostPort"]) for c in containers for p in c.get("ports") or [] if p.get("hostPort")]
    checks.append(("hostPort", ports and "; ".join(f'container "{n}" uses hostPort {p}' for n, p in ports)))
    privileged = [c["name"] for c in containers if sc(c).get("privileged")]
    checks.append(("privileged", privileged and (
        f"{_containers_phrase(privileged)} must not set securityContext.privileged=true")))
    if restricted:
        bad_vols = [(v["name"], next((k for k in v if k not in _NOT_VOLUME_TYPES), "")) for v in volumes]
        bad_vols = [(n, t) for n, t in bad_vols if t not in RESTRICTED_VOLUMES]
        if bad_vols:
            vol_names, types = [n for n, _ in bad_vols], sorted({t for _, t in bad_vols})
            verb = "uses" if len(vol_names) == 1 else "use"
            kind = "type" if len(types) == 1 else "types"
            checks.append(("restricted volume types", f"{_containers_phrase(vol_names, 'volume', 'volumes')} "
                                                      f"{verb} restricted volume {kind} {_quote(types)}"))
        checks.append(("runAsNonRoot != true", _run_as_non_root(pod_sc, containers)))
        root = []
        if pod_sc.get("runAsUser") == 0:
            root.append("pod must not set runAsUser=0")
        root_containers = [c["name"] for c in containers if sc(c).get("runAsUser") == 0]
        if root_containers:
            root.append(f"{_containers_phrase(root_containers)} must not set runAsUser=0")
        checks.append(("runAsUser=0", "; ".join(root) or None))
    checks.append(("seccompProfile", _seccomp(pod_sc, containers, restricted)))
    return [f"{reason} ({detail})" for reason, detail in checks if detail]


def _run_as_non_root(pod_sc: dict[str, Any], containers: list[dict[str, Any]]) -> str | None:
    details = []
    pod_value = pod_sc.get("runAsNonRoot")
    if pod_value is False:
        details.append("pod must not set securityContext.runAsNonRoot=false")
    explicit_false = [c["name"] for c in containers if (c.get("securityContext") or {}).get("runAsNonRoot") is False]
    if explicit_false:
        details.append(f"{_containers_phrase(explicit_false)} must not set securityContext.runAsNonRoot=false")
    if pod_value is None:
        unset = [c["name"] for c in containers if (c.get("securityContext") or {}).get("runAsNonRoot") is None]
        if unset:
            details.append(f"pod or {_containers_phrase(unset)} must set securityContext.runAsNonRoot=true")
    return "; ".join(details) or None


def _seccomp(pod_sc: dict[str, Any], containers: list[dict[str, Any]], restricted: bool) -> str | None:
    def kind(sc: dict[str, Any]) -> str | None:
        return (sc.get("seccompProfile") or {}).get("type")

    details = []
    if kind(pod_sc) == "Unconfined":
        details.append('pod must not set securityContext.seccompProfile.type to "Unconfined"')
    unconfined = [c["name"] for c in containers if kind(c.get("securityContext") or {}) == "Unconfined"]
    if unconfined:
        details.append(f'{_containers_phrase(unconfined)} must not set securityContext.seccompProfile.type to '
                       '"Unconfined"')
    if restricted and kind(pod_sc) is None:
        unset = [c["name"] for c in containers if kind(c.get("securityContext") or {}) is None]
        if unset:
            details.append(f'pod or {_containers_phrase(unset)} must set securityContext.seccompProfile.type to '
                           '"RuntimeDefault" or "Localhost"')
    return "; ".join(details) or None


# --------------------------------------------------------------------------------------- ResourceQuota

_COMPUTE = ("cpu", "memory", "ephemeral-storage")


def pod_usage(pod: dict[str, Any]) -> dict[str, Decimal]:
    """The quota resources one pod uses: ``pods``, ``requests.X``, ``limits.X`` (bare ``cpu`` = requests),
    with init containers counted as the API server does (the max of an init container and the sum of the
    others)."""
    spec = pod.get("spec") or {}
    out: dict[str, Decimal] = {"pods": Decimal(1), "count/pods": Decimal(1)}
    for side in ("requests", "limits"):
        total: dict[str, Decimal] = {}
        for c in spec.get("containers") or []:
            for res, value in ((c.get("resources") or {}).get(side) or {}).items():
                total[res] = total.get(res, Decimal(0)) + parse_quantity(value)
        for c in spec.get("initContainers") or []:
            for res, value in ((c.get("resources") or {}).get(side) or {}).items():
                total[res] = max(total.get(res, Decimal(0)), parse_quantity(value))
        for res, value in total.items():
            out[f"{side}.{res}"] = value
            if side == "requests" and res in _COMPUTE:
                out[res] = value
    return out


def _missing(quota_keys: set[str], pod: dict[str, Any]) -> list[str]:
    """``limits.cpu for: a,b`` for each compute resource the quota constrains that a container leaves out."""
    out = []
    containers = (pod.get("spec") or {}).get("containers") or []
    for key in sorted(quota_keys):
        side, _, res = key.partition(".") if "." in key else ("requests", "", key)
        if res not in _COMPUTE or side not in ("requests", "limits"):
            continue
        lacking = [c["name"] for c in containers if res not in ((c.get("resources") or {}).get(side) or {})]
        if lacking:
            out.append(f"{key} for: {','.join(lacking)}")
    return out


def format_quantity(value: Decimal, like: str) -> str:
    """A quantity in the notation of ``like`` (binary suffixes stay binary), the shortest exact form."""
    binary = (("Ei", 2 ** 60), ("Pi", 2 ** 50), ("Ti", 2 ** 40), ("Gi", 2 ** 30), ("Mi", 2 ** 20), ("Ki", 2 ** 10))
    decimal = (("E", 10 ** 18), ("P", 10 ** 15), ("T", 10 ** 12), ("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3))
    if value == 0:
        return "0"
    if like.endswith("i"):
        for suffix, factor in binary:
            if value % factor == 0:
                return f"{int(value // factor)}{suffix}"
    if value == value.to_integral_value():
        for suffix, factor in decimal:
            if value % factor == 0 and like[-1:] not in ("m", ""):
                return f"{int(value // factor)}{suffix}"
        return str(int(value))
    for suffix, factor in (("m", Decimal("1e-3")), ("u", Decimal("1e-6")), ("n", Decimal("1e-9"))):
        scaled = value / factor
        if scaled == scaled.to_integral_value():
            return f"{int(scaled)}{suffix}"
    return str(value)


def _pretty(values: dict[str, Decimal], hard: dict[str, str]) -> str:
    return ",".join(f"{k}={format_quantity(v, str(hard.get(k, '')))}" for k, v in sorted(values.items()))


# Core resources a quota can count by their bare name as well as by count/NAME.
LEGACY_COUNTS = {"configmaps", "persistentvolumeclaims", "replicationcontrollers", "resourcequotas", "secrets",
                 "services"}


def group_resource(resource: Any) -> str:
    """``deployments.apps``, ``services``: how the API server names a resource in its messages."""
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def count_problem(quota: dict[str, Any], resource: Any, existing: int) -> str | None:
    """The refusal when one more object of ``resource`` exceeds an object-count limit of ``quota``."""
    hard: dict[str, str] = {k: str(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
    keys = [f"count/{group_resource(resource)}"]
    if not resource.group and resource.plural in LEGACY_COUNTS:
        keys.append(str(resource.plural))
    over = sorted(k for k in keys if k in hard and existing + 1 > parse_quantity(hard[k]))
    if not over:
        return None
    name = quota["metadata"]["name"]
    return (f"exceeded quota: {name}, requested: {','.join(f'{k}=1' for k in over)}, "
            f"used: {','.join(f'{k}={existing}' for k in over)}, "
            f"limited: {','.join(f'{k}={hard[k]}' for k in over)}")


def quota_problem(quota: dict[str, Any], pod: dict[str, Any], live_pods: list[dict[str, Any]]) -> str | None:
    """kube-apiserver's refusal text when ``pod`` would exceed ``quota`` (or omits what it constrains)."""
    name = quota["metadata"]["name"]
    hard: dict[str, str] = {k: str(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
    missing = _missing(set(hard), pod)
    if missing:
        return f"failed quota: {name}: must specify {'; '.join(missing)}"
    requested = pod_usage(pod)
    used: dict[str, Decimal] = {}
    for other in live_pods:
        if (other.get("status") or {}).get("phase") in ("Succeeded", "Failed") or \
                (other.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for key, value in pod_usage(other).items():
            used[key] = used.get(key, Decimal(0)) + value
    over = [k for k in hard if k in requested
            and used.get(k, Decimal(0)) + requested[k] > parse_quantity(hard[k])]
    if not over:
        return None
    return (f"exceeded quota: {name}, requested: {_pretty({k: requested[k] for k in over}, hard)}, "
            f"used: {_pretty({k: used.get(k, Decimal(0)) for k in over}, hard)}, "
            f"limited: {','.join(f'{k}={hard[k]}' for k in sorted(over))}")

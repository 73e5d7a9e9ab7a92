"""What a job author may put into the pods the operator creates, and the limits a cluster admin sets.

The operator creates worker pods with its own cluster-wide ``pods/create`` permission, so a pod template
that could ask for the node's namespaces, a hostPath, a privileged or root container, or another service
account would let anyone who may create a GRTrainingJob do what their own RBAC forbids. Those fields are
refused (naming each) unless the cluster admin allows them (chart value
``operator.podSecurity.allowPrivileged``, ``grstack operator --allow-privileged-pods``), and every container
the operator creates or accepts gets the Pod Security Standards' ``restricted`` settings under whatever it
sets itself. The replica bound (``--max-replicas``, chart value ``operator.limits.maxReplicas``) lowers the
CRDs' hard ceiling (``names.MAX_REPLICAS``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from grstack.operator import names


@dataclass(frozen=True)
class ClusterPolicy:
    allow_privileged: bool = False
    max_replicas: int = names.MAX_REPLICAS


_current = ClusterPolicy()


def configure(policy: ClusterPolicy) -> None:
    """Set the policy of this operator process (from its command line, once, before it reconciles)."""
    global _current
    if not 1 <= policy.max_replicas <= names.MAX_REPLICAS:
        raise ValueError(f"max replicas {policy.max_replicas}: must be 1-{names.MAX_REPLICAS} (the CRDs' maximum)")
    _current = policy


def current() -> ClusterPolicy:
    return _current


ALLOW_HINT = ("a cluster admin can allow these with the chart value operator.podSecurity.allowPrivileged "
              "(grstack operator --allow-privileged-pods)")
_HOST_NAMESPACES = {"hostNetwork": "network", "hostPID": "process", "hostIPC": "IPC"}
_ACCOUNT_FIELDS = ("serviceAccountName", "serviceAccount", "automountServiceAccountToken")


def violations(spec: dict[str, Any], where: str = "spec") -> list[str]:
    """The fields of a PodSpec fragment that escape the restricted profile, each as ``path: why``."""
    out = [f"{where}.{key}: shares the node's {ns} namespace" for key, ns in _HOST_NAMESPACES.items()
           if spec.get(key)]
    out += [f"{where}.{key}: the operator sets the workers' service account (its token mounted on rank 0 only)"
            for key in _ACCOUNT_FIELDS if key in spec]
    for i, vol in enumerate(spec.get("volumes") or []):
        if isinstance(vol, dict) and "hostPath" in vol:
            out.append(f"{where}.volumes[{vol.get('name', i)}].hostPath: mounts a directory of the node")
    out += _context(spec.get("securityContext"), f"{where}.securityContext", container=False)
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(key) or []):
            if not isinstance(c, dict):
                continue
            at = f"{where}.{key}[{c.get('name') or i}]"
            out += _context(c.get("securityContext"), f"{at}.securityContext", container=True)
            out += [f"{at}.ports[{p.get('containerPort', j)}].hostPort: binds a port of the node"
                    for j, p in enumerate(c.get("ports") or []) if isinstance(p, dict) and p.get("hostPort")]
    return out


def _context(sc: Any, where: str, container: bool) -> list[str]:
    if not isinstance(sc, dict):
        return []
    out = []
    if sc.get("runAsUser") == 0:
        out.append(f"{where}.runAsUser: 0 runs as root")
    if sc.get("runAsNonRoot") is False:
        out.append(f"{where}.runAsNonRoot: false allows root")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append(f"{where}.seccompProfile: Unconfined turns off system-call filtering")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{where}.windowsOptions.hostProcess: runs on the node")
    if container:
        if sc.get("privileged"):
            out.append(f"{where}.privileged: true gives the container the node")
        if sc.get("allowPrivilegeEscalation") is True:
            out.append(f"{where}.allowPrivilegeEscalation: true lets a process gain privileges")
        added = (sc.get("capabilities") or {}).get("add")
        if added:
            out.append(f"{where}.capabilities.add: {', '.join(map(str, added))} (all capabilities are dropped)")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}.procMount: {sc['procMount']} unmasks /proc")
    return out


def check_template(spec: dict[str, Any]) -> None:
    """ValueError naming every field of a pod template the policy refuses."""
    if current().allow_privileged:
        return
    found = violations(spec)
    if found:
        raise ValueError(f"the pod template asks for more than the restricted pod security profile: "
                         f"{'; '.join(found)} ({ALLOW_HINT})")


def check_replicas(field: str, value: int) -> None:
    limit = current().max_replicas
    if value > limit:
        raise ValueError(f"{field}: {value} is above this cluster's limit of {limit} (chart value "
                         f"operator.limits.maxReplicas, grstack operator --max-replicas)")


def restricted_container(container: dict[str, Any], pod_context: dict[str, Any]) -> dict[str, Any]:
    """The container with the restricted profile's settings where it sets nothing stricter: no privilege
    escalation, all capabilities dropped, non-root, the runtime's seccomp profile (or the pod's)."""
    sc = copy.deepcopy(container.get("securityContext") or {})
    if not sc.get("privileged"):  # the API server refuses privileged without escalation
        sc.setdefault("allowPrivilegeEscalation", False)
    caps = sc.setdefault("capabilities", {})
    drop = list(caps.get("drop") or [])
    caps["drop"] = drop if "ALL" in drop else [*drop, "ALL"]
    user = sc.get("runAsUser", pod_context.get("runAsUser"))
    if user != 0 and "runAsNonRoot" not in sc and pod_context.get("runAsNonRoot") is not False:
        sc["runAsNonRoot"] = True
    if "seccompProfile" not in sc:
        sc["seccompProfile"] = copy.deepcopy(pod_context.get("seccompProfile") or {"type": "RuntimeDefault"})
    return {**container, "securityContext": sc}


def restrict(pod_spec: dict[str, Any], template: dict[str, Any]) -> None:
    """Apply ``restricted_container`` to every container and init container of a merged pod spec; a root
    user the template sets (only when allowed) drops the operator's pod-level runAsNonRoot."""
    pod_context = pod_spec.get("securityContext") or {}
    asked = template.get("securityContext") or {}
    if pod_context.get("runAsUser") == 0 and "runAsNonRoot" not in asked:
        pod_context.pop("runAsNonRoot", None)
    for key in ("initContainers", "containers"):
        if key in pod_spec:
            pod_spec[key] = [restricted_container(c, pod_context) for c in pod_spec[key]]

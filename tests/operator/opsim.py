"""A small Kubernetes for operator tests: KMock's API emulator with the API-server behaviour the operator
relies on, a garbage collector, and a local kubelet that runs pod commands as processes.

KMock stores objects and streams watch events but is deliberately simple (see docs/architecture.md §7).
What it lacks and this module adds:

- ``/api/v1/namespaces`` (create, get, list, watch, delete), which KMock cannot route;
- uid, creationTimestamp, resourceVersion and generation on writes (kopf and ownerReferences need them);
  a ``metadata.uid`` in a patch is a precondition (409 on mismatch), as in the real API server;
- for the grstack CRDs (``crds/*.yaml``, and any CRD applied through the API): structural pruning, defaulting
  and validation against the ``openAPIV3Schema`` with the ``x-kubernetes-validations`` CEL rules evaluated by
  cel-python (``oldSelf`` on update); a 422 ``Invalid`` answer naming the field, like the API server's; on
  create and on every update alike: merge patch, JSON patch, PUT (strategic merge for built-in kinds only),
  ``fieldValidation=Strict`` rejecting unknown fields;
- what the real ``kubectl`` needs: discovery with singular and short names and categories, OpenAPI v3 (and v2
  as JSON) documents built from the CRDs, lists with ``kind`` and ``resourceVersion``, label and field
  selectors on lists and watches, JSON-typed watch streams, ``as=Table`` output with the CRDs' printer
  columns (a default table for pods, Name/Age for the rest);
- writes to ``status`` through the main resource are ignored (status subresource semantics);
- kube-apiserver's request semantics (helpers in opsim_semantics.py): ``generateName``, ``dryRun=All``,
  watches with WatchList (``sendInitialEvents``), bookmarks, ``timeoutSeconds`` and ``410 Gone`` after
  ``compact()``, the ``autoscaling/v1`` Scale subresource, printer-column JSONPath filters, graceful deletion
  (finalizers, ``propagationPolicy``), server-side apply with ``managedFields``, the Events table;
- for Pods, Services, StatefulSets and Deployments (opsim_builtin.py): decoding against the published
  schemas, defaulting, canonical quantities and kube-apiserver's validation, with its 422 answers; with
  ``Cluster.start(controllers=True)``, StatefulSet, Deployment and HPA controllers (opsim_controllers.py);
- the garbage collector: objects whose owners are all gone are deleted (ownerReferences), and owners deleted
  in the foreground wait for their blocking dependents;
- the kubelet: a Pod becomes a local process (command/args/env with ``$(VAR)`` expansion and the downward
  API; ConfigMap, emptyDir and PVC volumes mapped to directories, paths in args/env rewritten; the headless
  Service address of rank 0 mapped to 127.0.0.1 and a free port; container ports and ``SERVICE:PORT`` in args
  made local and readiness probes run, see opsim_controllers.PodNetwork); phases Pending -> Running ->
  Succeeded/Failed with exit codes and termination messages are written back through the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import functools
import json
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import celpy
import jsonpatch
import jsonpointer
import jsonschema
import kmock
import yaml

from grstack.operator import crds

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the opsim_* modules, also when run as a script (-P)
import opsim_admission
import opsim_builtin
import opsim_controllers
import opsim_semantics

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# resource -> (kind, subresources, short names, categories); singular names are the lower-case kinds
CORE = {
    "v1/pods": ("Pod", {"status"}, {"po"}, {"all"}),
    "v1/services": ("Service", {"status"}, {"svc"}, {"all"}),
    "v1/configmaps": ("ConfigMap", set(), {"cm"}, set()),
    "v1/secrets": ("Secret", set(), set(), set()),
    "v1/serviceaccounts": ("ServiceAccount", set(), {"sa"}, set()),
    "v1/events": ("Event", set(), {"ev"}, set()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", {"status"}, {"pvc"}, set()),
    "v1/resourcequotas": ("ResourceQuota", {"status"}, {"quota"}, set()),
    "rbac.authorization.k8s.io/v1/roles": ("Role", set(), set(), set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", set(), set(), set()),
    "apps/v1/statefulsets": ("StatefulSet", {"status", "scale"}, {"sts"}, {"all"}),
    "apps/v1/deployments": ("Deployment", {"status", "scale"}, {"deploy"}, {"all"}),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", {"status"}, {"hpa"}, {"all"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", {"status"}, {"pdb"}, set()),
    "coordination.k8s.io/v1/leases": ("Lease", set(), set(), set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", set(), {"netpol"}, set()),  # the chart's
}
CLUSTER = {  # cluster-scoped resources (kopf looks for some during discovery; the chart creates the RBAC ones)
    "v1/namespaces": ("Namespace", {"ns"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", {"crd", "crds"}),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", set()),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", set()),
}
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}
CRD_KEY = "apiextensions.k8s.io/v1/customresourcedefinitions"
TABLE = {"kind": "Table", "apiVersion": "meta.k8s.io/v1"}
REPLACE = "X-Opsim-Replace"  # marks a PUT handed to KMock as a PATCH
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply


# ------------------------------------------------------------------------------------ CRD schema handling


ROOT_FIELDS = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
               "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}


def with_root_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema as the API server applies it: ``apiVersion``, ``kind`` and ``metadata`` are always known
    at the root, whether the CRD lists them or not (kopf's peering CRDs do not)."""
    props = schema.get("properties")
    if props is None or schema.get("x-kubernetes-preserve-unknown-fields"):
        return schema
    return {**schema, "properties": {**ROOT_FIELDS, **props}}


def prune(obj: Any, schema: dict[str, Any]) -> Any:
    """Structural pruning: drop fields the schema does not know (unless it preserves unknown fields)."""
    if isinstance(obj, dict):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return obj
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is not None:
            return {k: prune(v, props[k]) for k, v in obj.items() if k in props}
        if isinstance(extra, dict):
            return {k: prune(v, extra) for k, v in obj.items()}
        return obj
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"]) for v in obj]
    return obj


def default(obj: Any, schema: dict[str, Any]) -> Any:
    """Apply ``default`` values the way the API server does (recursively, into defaulted objects too)."""
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        out = dict(obj)
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = default(out[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in out:
                if key not in props:
                    out[key] = default(out[key], extra)
        return out
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [default(v, schema["items"]) for v in obj]
    return obj


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields pruning would drop (``fieldValidation=Strict`` rejects them instead)."""
    out: list[str] = []
    if isinstance(obj, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}" if path else key)
            elif props is not None:
                out.append(f"{path}.{key}" if path else key)
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}.{key}" if path else key)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            out += unknown_fields(value, schema["items"], f"{path}[{i}]")
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Violations of the CRD schema, phrased like the API server (``spec.x: Invalid value: ...``); ``old`` is
    the stored object on update (CEL transition rules, those using ``oldSelf``, run only then)."""
    validator = jsonschema.Draft4Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "<root>"
        out.append(f"{where}: Invalid value: {err.message}")
    out += cel_errors(obj, schema, [], old)
    return out


_MISSING = object()


@functools.cache
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(obj: Any, schema: dict[str, Any], path: list[str], old: Any = _MISSING) -> list[str]:
    """``x-kubernetes-validations`` rules evaluated by a CEL interpreter (cel-python), at every node that has
    them: ``self`` is the node, ``oldSelf`` the stored node on update (rules using it are skipped on create
    and where the node is new, as the API server does)."""
    out = []
    where = ".".join(path) or "<root>"
    for rule in schema.get("x-kubernetes-validations", []):
        text = rule["rule"]
        transition = re.search(r"\boldSelf\b", text) is not None
        if transition and (old is _MISSING or old is None):
            continue
        activation = {"self": celpy.json_to_cel(obj)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = _cel_program(text).evaluate(activation)
        except Exception as exc:  # a compile or evaluation error is the rule's failure, as in the API server
            out.append(f"{where}: Invalid value: rule {text!r} could not be evaluated: {exc}")
            continue
        if isinstance(result, Exception) or not bool(result):
            message = rule.get("message") or f"failed rule: {text}"
            out.append(f"{where}: Invalid value: {message}")
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            sub = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if sub is not None:
                prev = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                out += cel_errors(value, sub, [*path, key], prev)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            out += cel_errors(value, schema["items"], [*path[:-1], f"{path[-1] if path else ''}[{i}]"], _MISSING)
    return out


def admit_custom_resource(obj: dict[str, Any], schema: dict[str, Any],
                          old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """What the API server stores for a custom resource (pruned, defaulted), and why it would reject it (on
    create, or on update with ``old`` the stored object)."""
    stored = default(prune(obj, schema), schema)
    stored["metadata"] = obj.get("metadata", {})
    return stored, schema_errors(stored, schema, old)


# ------------------------------------------------------------------------------------------- API server


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bad(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``application/merge-patch+json``)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A simplified strategic merge patch for built-in kinds (what ``kubectl apply``/``patch`` send): dicts
    merge as in a merge patch, lists of objects merge by their ``name`` key (containers, env, volumes, ports),
    ``$patch: delete`` removes a list element, other ``$`` directives are ignored; other lists are replaced.
    (The API server takes the merge keys and strategies from the Go types; this covers the common ones.)"""
    if not isinstance(patch, dict):
        if isinstance(patch, list) and isinstance(target, list) and _mergeable(target) and _mergeable(patch):
            out = [copy.deepcopy(t) for t in target]
            for item in patch:
                idx = next((i for i, t in enumerate(out) if t.get("name") == item.get("name")), None)
                if item.get("$patch") == "delete":
                    if idx is not None:
                        out.pop(idx)
                elif idx is None:
                    out.append(strategic_merge_patch({}, item))
                else:
                    out[idx] = strategic_merge_patch(out[idx], item)
            return out
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def _mergeable(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that turns ``old`` into ``new`` (how a computed object is handed to KMock's store)."""
    out: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old or old[key] != value:
            if isinstance(value, dict) and isinstance(old.get(key), dict):
                out[key] = merge_diff(old[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def json_path(obj: Any, path: str) -> Any:
    """The first value a printer column's or field selector's JSONPath selects (filters such as
    ``.status.conditions[?(@.type=="Ready")].status`` included: opsim_semantics); None when none."""
    try:
        return opsim_semantics.first(obj, path)
    except opsim_semantics.JsonPathError:
        return None


def human_age(timestamp: str | None) -> str:
    """``kubectl``'s age format (``45s``, ``3m12s``, ``5h``, ``2d``)."""
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    secs = max(0, int((dt.datetime.now(dt.UTC) - then).total_seconds()))
    if secs < 120:
        return f"{secs}s"
    if secs < 600:
        return f"{secs // 60}m{secs % 60}s" if secs % 60 else f"{secs // 60}m"
    if secs < 3 * 3600:
        return f"{secs // 60}m"
    if secs < 48 * 3600:
        return f"{secs // 3600}h"
    return f"{secs // 86400}d"


def _match_labels(labels: dict[str, str], selector: str) -> bool:
    """Equality- and set-based label selectors (``a=b,c!=d,e,!f,g in (x,y),h notin (z)``)."""
    for term in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        term = term.strip()
        if not term:
            continue
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", term):
            values = {v.strip() for v in m.group(3).split(",")}
            present = m.group(1) in labels and labels[m.group(1)] in values
            if present != (m.group(2) == "in"):
                return False
        elif m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term):
            equal = labels.get(m.group(1)) == m.group(3)
            if equal != (m.group(2) != "!="):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _match_fields(obj: dict[str, Any], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        m = re.fullmatch(r"([^!=]+)(==|=|!=)(.*)", term)
        if m is None:
            raise _bad(400, "BadRequest", f"invalid field selector: {term!r}")
        value = json_path(obj, "." + m.group(1))
        equal = (str(value) if value is not None else "") == m.group(3)
        if equal != (m.group(2) != "!="):
            return False
    return True


def selected(obj: dict[str, Any], params: Any) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return (_match_labels(labels, params.get("labelSelector") or "")
            and _match_fields(obj, params.get("fieldSelector") or ""))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def wants_table(headers: Any) -> bool:
    return "as=Table" in (headers.get("Accept") or "")


POD_COLUMNS = [("Ready", "string", 0), ("Status", "string", 0), ("Restarts", "integer", 0), ("Age", "string", 0),
               ("IP", "string", 1), ("Node", "string", 1)]


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        phase = "Terminating"
    ready = sum(1 for s in statuses if s.get("ready"))
    return [f"{ready}/{len(containers)}", phase, sum(int(s.get("restartCount") or 0) for s in statuses),
            human_age(pod["metadata"].get("creationTimestamp")), (pod.get("status") or {}).get("podIP"),
            (pod.get("spec") or {}).get("nodeName")]


EVENT_COLUMNS = [("Last Seen", 0), ("Type", 0), ("Reason", 0), ("Object", 0), ("Message", 0), ("Name", 1)]


def _event_cells(event: dict[str, Any]) -> list[Any]:
    about = event.get("involvedObject") or event.get("regarding") or {}
    seen = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    return [human_age(seen), event.get("type"), event.get("reason"),
            f"{str(about.get('kind', '')).lower()}/{about.get('name', '')}", event.get("message") or event.get("note"),
            event["metadata"]["name"]]


def _protobuf_fields(buf: bytes) -> dict[int, bytes | int]:
    """The top-level fields of a protobuf message (varint and length-delimited ones; enough for names)."""
    out: dict[int, bytes | int] = {}
    i = 0

    def varint() -> int:
        nonlocal i
        value = shift = 0
        while True:
            byte = buf[i]
            i += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value
    while i < len(buf):
        key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            out.setdefault(field, varint())
        elif wire == 2:
            size = varint()
            out.setdefault(field, buf[i:i + size])
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            break
    return out


def _protobuf_name(body: bytes) -> str:
    """``metadata.name`` of a built-in object sent as ``application/vnd.kubernetes.protobuf`` (the ``k8s\\0``
    envelope holding runtime.Unknown, whose raw bytes hold the object; ObjectMeta is field 1, name its 1)."""
    if not body.startswith(b"k8s\x00"):
        raise _bad(415, "UnsupportedMediaType", "not a Kubernetes protobuf envelope")
    raw = _protobuf_fields(body[4:]).get(2, b"")
    meta = _protobuf_fields(raw if isinstance(raw, bytes) else b"").get(1, b"")
    name = _protobuf_fields(meta if isinstance(meta, bytes) else b"").get(1, b"")
    return name.decode() if isinstance(name, bytes) else ""


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """KMock's emulator plus the API-server behaviour listed in the module docstring."""

    custom: dict[Any, tuple[str, dict[str, Any]]] = attrs.field(factory=dict)  # resource -> (kind, schema)
    columns: dict[Any, list[dict[str, Any]]] = attrs.field(factory=dict)  # resource -> additionalPrinterColumns
    namespaces: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    builtin_defaults: opsim_builtin.Defaults = attrs.field(factory=opsim_builtin.Defaults)  # Service cluster IPs
    scales: dict[Any, tuple[str, str, str | None]] = attrs.field(factory=dict)  # resource -> scale paths (CRDs)
    compacted_rv: int = 0  # watches and exact lists from an older resourceVersion get 410 Gone (see compact)
    bookmark_seconds: float = 5.0  # BOOKMARK period on watches with allowWatchBookmarks=true
    expired_answers: int = 0  # how many 410 Gone answers were given (tests check that a client relisted)
    open_watches: dict[str, int] = attrs.field(factory=dict)  # resource plural -> watches being served
    _watch_queues: set[asyncio.Queue[Any]] = attrs.field(factory=set)  # of the watches being served
    _tombstones: list[dict[str, Any]] = attrs.field(factory=list)  # the last state of deleted objects
    _rv: int = 0

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, subresources, short, categories) in CORE.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=VERBS, singular=kind.lower(),
                                                     subresources=subresources, shortnames=short,
                                                     categories=categories)
        for key, (kind, short) in CLUSTER.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=False, verbs=VERBS, singular=kind.lower(),
                                                     shortnames=short)
        for path in sorted((REPO / "crds").glob("*.yaml")):  # the generated CRDs, as if applied at start
            self.register_crd(yaml.safe_load(path.read_text()))

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CustomResourceDefinition's resource: discovery names, schema, printer columns."""
        spec = crd["spec"]
        names_ = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            key = f"{spec['group']}/{version['name']}/{names_['plural']}"
            subresources = set(version.get("subresources") or {})
            self.resources[key] = kmock.ResourceInfo(
                kind=names_["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=VERBS,
                singular=names_.get("singular") or names_["kind"].lower(), shortnames=set(names_.get("shortNames") or ()),
                categories=set(names_.get("categories") or ()), subresources=subresources)
            res = kmock.resource(key)
            self.custom[res] = (names_["kind"], with_root_fields(version["schema"]["openAPIV3Schema"]))
            self.columns[res] = list(version.get("additionalPrinterColumns") or [])
            scale = (version.get("subresources") or {}).get("scale")
            if isinstance(scale, dict):
                self.scales[res] = (scale["specReplicasPath"], scale["statusReplicasPath"],
                                    scale.get("labelSelectorPath"))

    def compact(self, drop_watches: bool = False) -> int:
        """Forget the history before the current resourceVersion, like etcd compaction: a watch or an exact
        list from an older one then gets ``410 Gone`` (reason Expired) and a client must list again. With
        ``drop_watches`` the open watches end too (as when the API server restarts), so clients re-watch from
        the resourceVersion they last saw and meet the 410."""
        self.compacted_rv = self._rv
        self._tombstones.clear()
        if drop_watches:
            for queue in self._watch_queues:
                queue.put_nowait(None)  # the end of that stream, after what it has already been sent
        return self._rv

    def _expired(self, rv: str | None) -> kmock.KubernetesError | None:
        since = _int(rv)
        if since and since < self.compacted_rv:
            self.expired_answers += 1
            return _bad(410, "Expired", f"too old resource version: {since} ({self.compacted_rv})")
        return None

    def _info(self, res: Any) -> Any:
        try:
            return self.resources[res]
        except KeyError:
            return None

    # -- requests KMock does not route -----------------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw.path.startswith("/openapi/"):
            return self._openapi(raw)
        if raw.query.get("watch") in ("true", "1"):
            # KMock streams with aiohttp's default application/octet-stream, for which client-go has no
            # stream decoder (kubectl wait/delete would fall back to re-listing): label watches as JSON.
            hook = raw._prepare_hook

            async def json_stream(response: aiohttp.web.StreamResponse) -> None:
                if response.content_type == "application/octet-stream":
                    response.content_type = "application/json"
                await hook(response)
            object.__setattr__(raw, "_prepare_hook", json_stream)
        # KMock cannot parse /api/v1/namespaces[/name] (it reads "namespaces" as the namespace prefix).
        match = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?/?", raw.path)
        if match is None:
            if raw.method == "PUT":  # KMock routes no PUT: an update (replace) goes through the patch path
                headers = {**raw.headers, "Content-Type": "application/json", REPLACE: "1"}
                raw = raw.clone(method="PATCH", headers=headers)
            return await super().__call__(raw)
        return await self._namespace(raw, match.group(1))

    def _served(self) -> list[tuple[str, str, str, Any]]:
        """(group, version, plural, info) of every served resource."""
        out = {}
        for res in self._get_resources():
            info = self._info(res)
            if info is not None and res.plural and res.group is not None and res.version:
                out[(res.group, res.version, res.plural)] = info
        return [(*key, info) for key, info in sorted(out.items())]

    def _schema_of(self, group: str, version: str, plural: str) -> dict[str, Any]:
        custom = self.custom.get(kmock.resource(f"{group}/{version}/{plural}" if group else f"{version}/{plural}"))
        return copy.deepcopy(custom[1]) if custom else {"type": "object", "x-kubernetes-preserve-unknown-fields": True}

    @staticmethod
    def _definition_name(group: str, version: str, kind: str) -> str:
        if not group:
            return f"io.k8s.api.core.{version}.{kind}"
        return ".".join(reversed(group.split("."))) + f".{version}.{kind}"

    def _openapi(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """OpenAPI v2 (JSON) and v3 documents built from the served resources and the CRDs' schemas. The v3
        PATCH operations declare the ``fieldValidation`` parameter, so ``kubectl apply`` validates through the
        server (as against a real API server) instead of downloading v2."""
        web = aiohttp.web
        served = self._served()
        if raw.path.rstrip("/") == "/openapi/v2":
            accept = raw.headers.get("Accept", "")
            if accept and "json" not in accept and "*/*" not in accept:
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 406,
                                          "reason": "NotAcceptable",
                                          "message": "the emulator serves OpenAPI v2 as JSON only (and v3)"},
                                         status=406)
            definitions = {}
            for group, version, plural, info in served:
                schema = self._schema_of(group, version, plural)
                schema.pop("x-kubernetes-validations", None)
                schema["x-kubernetes-group-version-kind"] = [{"group": group, "version": version, "kind": info.kind}]
                definitions[self._definition_name(group, version, info.kind)] = schema
            return web.json_response({"swagger": "2.0", "info": {"title": "Kubernetes (grstack emulator)",
                                                                  "version": "v1.32.0"},
                                      "paths": {}, "definitions": definitions})
        gvs = sorted({("api/v1" if not g else f"apis/{g}/{v}") for g, v, _, _ in served})
        rest = raw.path.removeprefix("/openapi/v3").strip("/")
        if not rest:
            return web.json_response({"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={self._rv}"}
                                                for gv in gvs}})
        if rest not in gvs:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        paths: dict[str, Any] = {}
        schemas: dict[str, Any] = {}
        for group, version, plural, info in served:
            if ("api/v1" if not group else f"apis/{group}/{version}") != rest:
                continue
            gvk = {"group": group, "version": version, "kind": info.kind}
            ref = self._definition_name(group, version, info.kind)
            schema = self._schema_of(group, version, plural)
            schema["x-kubernetes-group-version-kind"] = [gvk]
            schemas[ref] = schema
            body = {"schema": {"$ref": f"#/components/schemas/{ref}"}}
            # No strategic merge listed even for built-ins: kubectl then computes it from its compiled-in types
            # (the schemas here are not the built-in types'); the emulator accepts it for built-ins.
            patch_types = ["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]
            params = [{"name": n, "in": "query", "schema": {"type": "string"}}
                      for n in ("dryRun", "fieldManager", "fieldValidation")]
            prefix = f"/api/{version}" if not group else f"/apis/{group}/{version}"
            scope = f"{prefix}/namespaces/{{namespace}}/{plural}" if info.namespaced else f"{prefix}/{plural}"

            def op(action: str, **extra: Any) -> dict[str, Any]:
                return {"x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk,  # noqa: B023
                        "responses": {"200": {"description": "OK", "content": {"application/json": body}}},  # noqa: B023
                        **extra}
            paths[scope] = {"get": op("list"), "post": op("post", parameters=params,
                                                          requestBody={"content": {"application/json": body}})}
            paths[f"{scope}/{{name}}"] = {
                "get": op("get"), "delete": op("delete"),
                "put": op("put", parameters=params, requestBody={"content": {"application/json": body}}),
                "patch": op("patch", parameters=[*params, {"name": "force", "in": "query",
                                                           "schema": {"type": "boolean"}}],
                            requestBody={"content": {t: body for t in patch_types}})}
        return web.json_response({"openapi": "3.0.0", "info": {"title": "Kubernetes (grstack emulator)",
                                                               "version": "v1.32.0"},
                                  "paths": paths, "components": {"schemas": schemas}})

    async def _namespace(self, raw: aiohttp.web.BaseRequest, name: str | None) -> aiohttp.web.StreamResponse:
        web = aiohttp.web
        self.namespaces.setdefault("default", self._namespace_object("default"))
        if raw.method == "POST":
            body = await raw.read()
            labels: dict[str, str] = {}
            if raw.content_type == "application/vnd.kubernetes.protobuf":  # kubectl create namespace
                ns_name = _protobuf_name(body)
            else:
                ns_name = json.loads(body)["metadata"]["name"]
                labels = json.loads(body)["metadata"].get("labels") or {}
            obj = self._namespace_object(ns_name)
            if labels:  # e.g. pod-security.kubernetes.io/enforce (opsim_admission)
                obj["metadata"]["labels"] = dict(labels)
            if obj["metadata"]["name"] in self.namespaces:
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409,
                                          "reason": "AlreadyExists",
                                          "message": f'namespaces "{obj["metadata"]["name"]}" already exists'},
                                         status=409)
            self.namespaces[obj["metadata"]["name"]] = obj
            return web.json_response(obj, status=201)
        if name is not None:
            obj = self.namespaces.pop(name, None) if raw.method == "DELETE" else self.namespaces.get(name)
            if obj is None:
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                                          "reason": "NotFound", "message": f'namespaces "{name}" not found',
                                          "details": {"name": name, "kind": "namespaces"}}, status=404)
            if raw.method == "PATCH":  # kubectl label/annotate namespace (Pod Security levels: opsim_admission)
                patched = merge_patch(obj.get("metadata") or {}, (json.loads(await raw.read() or b"{}") or {})
                                      .get("metadata") or {})
                for key in ("labels", "annotations"):
                    if key in patched:
                        obj["metadata"][key] = patched[key]
                    else:
                        obj["metadata"].pop(key, None)
                obj["metadata"]["resourceVersion"] = self._next_rv()
            if wants_table(raw.headers):
                return web.json_response(self._table(kmock.resource("v1/namespaces"), [obj], raw.query))
            return web.json_response(obj)
        items = [o for o in self.namespaces.values() if selected(o, raw.query)]
        if raw.query.get("watch") in ("true", "1"):  # the current namespaces, then silence until the client leaves
            response = web.StreamResponse()
            await response.prepare(raw)
            for obj in items:
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            await asyncio.sleep(float(raw.query.get("timeoutSeconds", 3600)))
            return response
        if wants_table(raw.headers):
            return web.json_response(self._table(kmock.resource("v1/namespaces"), items, raw.query))
        return web.json_response({"kind": "NamespaceList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self._rv)}, "items": items})

    def _namespace_object(self, name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                             "resourceVersion": self._next_rv()}, "status": {"phase": "Active"}}

    async def _serve_version(self, request: kmock.Request) -> Any:
        """Discovery of one group version: ``v1`` (not ``/v1``) for the core group; subresources carry no
        singular or short names (kubectl would warn that ``grtj`` also matches ``grtrainingjobs/status``); a
        ``/scale`` subresource is an ``autoscaling/v1`` Scale (client-go's scale client converts by it)."""
        payload = await super()._serve_version(request)
        if request.resource.group == "":
            payload["groupVersion"] = request.resource.version
        for entry in payload["resources"]:
            if "/" in entry["name"]:
                entry.update(singularName="", shortNames=[], categories=[])
                entry["verbs"] = ["get", "patch", "update"]
                if entry["name"].endswith("/scale"):
                    entry.update(group="autoscaling", version="v1", kind="Scale")
            elif not entry["categories"]:
                entry.pop("categories")
        payload["resources"].sort(key=lambda e: e["name"])
        return payload

    # -- reads: list kinds, resource versions, selectors, Table output ------------------------------------
    def _table(self, res: Any, objs: list[dict[str, Any]], params: Any) -> dict[str, Any]:
        """``as=Table``: the CRD's additionalPrinterColumns (Name first), pods' default columns, or Name/Age."""
        name_col = {"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}
        printer = self.columns.get(res)
        if printer is not None:
            cols = [name_col] + [{"name": c["name"], "type": c.get("type", "string"), "format": c.get("format", ""),
                                  "description": c.get("description", ""), "priority": c.get("priority", 0)}
                                 for c in printer]

            def cells(o: dict[str, Any]) -> list[Any]:
                out = [o["metadata"]["name"]]
                for c in printer:
                    value = json_path(o, c["jsonPath"])
                    out.append(human_age(value) if c.get("type") == "date" and value else value)
                return out
        elif res.plural == "pods" and res.group == "":
            cols = [name_col] + [{"name": n, "type": t, "format": "", "description": "", "priority": p}
                                 for n, t, p in POD_COLUMNS]

            def cells(o: dict[str, Any]) -> list[Any]:
                return [o["metadata"]["name"], *_pod_cells(o)]
        elif res.plural == "events" and res.group == "":  # kube-apiserver's event columns (Name is wide-only)
            cols = [{"name": n, "type": "string", "format": "", "description": "", "priority": p}
                    for n, p in EVENT_COLUMNS]

            def cells(o: dict[str, Any]) -> list[Any]:
                return _event_cells(o)
        else:
            cols = [name_col, {"name": "Age", "type": "string", "format": "", "priority": 0,
                               "description": "time since creation"}]

            def cells(o: dict[str, Any]) -> list[Any]:
                return [o["metadata"]["name"], human_age(o["metadata"].get("creationTimestamp"))]
        include = params.get("includeObject") or "Metadata"
        rows = []
        for o in objs:
            row: dict[str, Any] = {"cells": cells(o)}
            if include == "Object":
                row["object"] = o
            elif include == "Metadata":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": o.get("metadata", {})}
            rows.append(row)
        return {**TABLE, "metadata": {"resourceVersion": str(self._rv)}, "columnDefinitions": cols, "rows": rows}

    def _kind(self, res: Any) -> str:
        info = self._info(res)
        return info.kind if info is not None and info.kind else res.plural.capitalize()

    async def _serve_list(self, request: kmock.Request) -> Any:
        exact = request.params.get("resourceVersionMatch") == "Exact" or request.params.get("continue")
        if exact and (expired := self._expired(request.params.get("resourceVersion"))) is not None:
            raise expired
        payload = await super()._serve_list(request)
        items = [o for o in payload["items"] if selected(o, request.params)]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"].get("name") or ""))
        if wants_table(request.headers):
            return self._table(request.resource, items, request.params)
        res = request.resource
        return {"kind": self._kind(res) + "List", "apiVersion": f"{res.group}/{res.version}" if res.group else res.version,
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = await super()._serve_fetch(request)
        if wants_table(request.headers) and request.subresource is None:
            return self._table(request.resource, [obj], request.params)
        return obj

    def _of(self, res: Any, obj: dict[str, Any]) -> bool:
        """Whether a tombstone is of resource ``res`` (by apiVersion; the kind is checked by the caller)."""
        api = f"{res.group}/{res.version}" if res.group else res.version
        return obj.get("apiVersion", api) == api

    def _in_scope(self, request: kmock.Request, namespace: str | None, name: str | None) -> bool:
        return (request.namespace is None or namespace == request.namespace) and \
            (request.name is None or name == request.name)

    def _bookmark(self, res: Any, rv: int, initial_end: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        api = f"{res.group}/{res.version}" if res.group else res.version
        return {"type": "BOOKMARK", "object": {"kind": self._kind(res), "apiVersion": api, "metadata": meta}}

    async def _serve_watch(self, request: kmock.Request) -> Any:
        """A watch as kube-apiserver serves it, on KMock's store and event bus: the current objects as ADDED
        (those newer than ``resourceVersion``), then every change; with ``sendInitialEvents=true`` (WatchList,
        what client-go >= 1.35 informers and ``kubectl wait`` send) all current objects and then a BOOKMARK
        annotated ``k8s.io/initial-events-end``; with ``allowWatchBookmarks=true`` a BOOKMARK every
        ``bookmark_seconds`` while idle; an ERROR 410 Expired from a compacted resourceVersion; the stream
        ends after ``timeoutSeconds``."""
        params = request.params
        yield b""  # the headers go out now: the client sees a live stream even if nothing happens
        if (expired := self._expired(params.get("resourceVersion"))) is not None:
            yield {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                               "status": "Failure", "code": 410, "reason": "Expired",
                                               "message": expired.message}}
            return
        res: Any = request.resource
        table = wants_table(request.headers)
        since = _int(params.get("resourceVersion"))
        initial = params.get("sendInitialEvents") == "true"
        bookmarks = params.get("allowWatchBookmarks") == "true" and not table
        bus = self._buses[res]
        async with self._lock:  # writers publish under this lock: nothing falls between snapshot and stream
            marker = await bus.mark()
            snapshot = [copy.deepcopy(o.raw) for (r, ns, name), o in list(self.objects.items())
                        if r == res and not o.deleted and self._in_scope(request, ns, name)]
            kind = self._kind(res)
            gone = [copy.deepcopy(t) for t in self._tombstones if since and not initial
                    and _int(t["metadata"].get("resourceVersion")) > since and t.get("kind", kind) == kind
                    and self._in_scope(request, t["metadata"].get("namespace"), t["metadata"].get("name"))
                    and self._of(res, t)]
            seen = self._rv
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            async for item in bus.stream(since=marker):
                queue.put_nowait(item)

        def shown(event: dict[str, Any]) -> dict[str, Any]:
            if table:
                return {"type": event["type"], "object": self._table(res, [event["object"]], params)}
            return event

        task = asyncio.create_task(pump())
        self.open_watches[res.plural] = self.open_watches.get(res.plural, 0) + 1
        self._watch_queues.add(queue)
        loop = asyncio.get_running_loop()
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        deadline = loop.time() + timeout if timeout else float("inf")
        try:
            replay = [("ADDED", o) for o in snapshot] + [("DELETED", o) for o in gone]
            replay.sort(key=lambda pair: _int(pair[1]["metadata"].get("resourceVersion")))
            for type_, obj in replay:  # (a deletion since ``since`` too: the client may have listed the object)
                if selected(obj, params) and (initial or _int(obj["metadata"].get("resourceVersion")) > since):
                    yield shown({"type": type_, "object": obj})
            if initial:
                yield self._bookmark(res, seen, initial_end=True)
            next_bookmark = loop.time() + self.bookmark_seconds
            while True:
                if loop.time() >= deadline:
                    return
                try:
                    due = [deadline - loop.time()] + ([next_bookmark - loop.time()] if bookmarks else [])
                    event = await asyncio.wait_for(queue.get(), None if min(due) == float("inf") else
                                                   max(0.0, min(due)))
                except TimeoutError:
                    if bookmarks and loop.time() >= next_bookmark:
                        yield self._bookmark(res, seen)
                        next_bookmark = loop.time() + self.bookmark_seconds
                    continue
                if event is None:  # compact(drop_watches=True)
                    return
                changed: Any = event.get("object") if isinstance(event, dict) else None
                if not isinstance(changed, dict):
                    continue
                meta = changed.get("metadata") or {}
                seen = max(seen, _int(meta.get("resourceVersion")))
                if self._in_scope(request, meta.get("namespace"), meta.get("name")) and selected(changed, params):
                    yield shown(event)
        finally:
            self.open_watches[res.plural] -= 1
            self._watch_queues.discard(queue)
            task.cancel()
            with contextlib.suppress(Exception):
                await bus.unmark(marker)

    # -- writes: admission on create, update and patch --------------------------------------------------
    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None:
            dry = request.params.get("dryRun")
            if dry not in (None, "All"):
                raise _bad(400, "BadRequest", f"unsupported dryRun value {dry!r}: only All is valid")
            ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
            if request.subresource == "scale" and request.name is not None:
                return await self._scale(request, dry == "All")
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._admit_create(request, dry == "All")
                if dry == "All":  # admitted and answered as if created; nothing is stored or announced
                    if self._stored(request.resource, request.data["metadata"].get("namespace"),
                                    request.data["metadata"]["name"]) is not None:
                        raise _bad(409, "AlreadyExists", f'{request.resource.plural} '
                                                         f'"{request.data["metadata"]["name"]}" already exists')
                    return aiohttp.web.json_response(request.data, status=201)
            elif request.action == kmock.action.UPDATE and request.name is not None and ctype == APPLY_PATCH:
                return await self._server_side_apply(request, dry == "All")
            elif request.action == kmock.action.UPDATE and request.name is not None:
                current = self._stored(request.resource, request.namespace, request.name)
                self._admit_update(request, dry == "All")
                if dry == "All" and current is not None:
                    return aiohttp.web.json_response(merge_patch(current, request.data))
                if current is not None and (current["metadata"].get("deletionTimestamp")
                                            and not merge_patch(current, request.data)["metadata"].get("finalizers")):
                    return await self._release(request)
            elif request.action == kmock.action.DELETE and request.name is not None:
                return await self._delete(request, dry == "All")
        return await super()._handle(request)

    def _derived(self, request: kmock.Request, **changes: Any) -> kmock.Request:
        """A request the emulator makes of itself (a scale write as an object patch, an apply as a create or
        replace); recorded like a received one, since KMock's reactions only serve requests it has seen."""
        inner = attrs.evolve(request, **changes)
        self._requests.append(inner)
        return inner

    def _stored(self, res: Any, namespace: str | None, name: str | None) -> dict[str, Any] | None:
        key: Any = (res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _not_found(self, res: Any, name: str | None) -> kmock.KubernetesError:
        plural = f"{res.plural}.{res.group}" if res.group else res.plural
        return _bad(404, "NotFound", f'{plural} "{name}" not found', name=name, group=res.group, kind=res.plural)

    async def _delete(self, request: kmock.Request, dry: bool) -> aiohttp.web.StreamResponse:
        """DELETE as kube-apiserver does it: DeleteOptions preconditions; an object with finalizers (or
        ``propagationPolicy: Foreground``, which adds ``foregroundDeletion``) only gets a deletionTimestamp and
        stays, Terminating, until they are removed (202); ``Orphan`` strips the owner from its dependents'
        ownerReferences first; ``Background`` (the default) deletes now and leaves the dependents to the
        garbage collector (collect_garbage)."""
        res: Any = request.resource
        web = aiohttp.web
        options = request.data if isinstance(request.data, dict) else {}
        dry = dry or "All" in (options.get("dryRun") or [])  # kubectl sends it in the DeleteOptions body
        policy = options.get("propagationPolicy") or request.params.get("propagationPolicy")
        if policy is None and (options.get("orphanDependents") is True
                               or request.params.get("orphanDependents") == "true"):
            policy = "Orphan"
        if policy not in (None, "Foreground", "Background", "Orphan"):
            raise _bad(422, "Invalid", f"propagationPolicy: Unsupported value: {policy!r}: supported values: "
                                       '"Foreground", "Background", "Orphan"')
        async with self._lock:
            key: Any = (res, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                raise self._not_found(res, request.name)
            entry = self.objects[key]
            current = copy.deepcopy(entry.raw)
            meta = current.get("metadata") or {}
            pre = options.get("preconditions") or {}
            for field in ("uid", "resourceVersion"):
                if pre.get(field) and pre[field] != meta.get(field):
                    raise _bad(409, "Conflict", f"Precondition failed: {field} in precondition: {pre[field]}, "
                                                f"{field} in object meta: {meta.get(field)}")
            if dry or meta.get("deletionTimestamp"):  # a dry run, or already Terminating: nothing changes
                return web.json_response(current, status=202 if meta.get("deletionTimestamp") else 200)
            if policy == "Orphan":
                await self._orphan_dependents(meta.get("uid"))
            finalizers = list(meta.get("finalizers") or [])
            if policy == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            if finalizers:
                entry.patch({"metadata": {"deletionTimestamp": _now(), "deletionGracePeriodSeconds": 0,
                                          "finalizers": finalizers, "resourceVersion": self._next_rv()}})
                raw = entry.raw
                await self._buses[res].put({"type": "MODIFIED", "object": raw})
                return web.json_response(raw, status=202)
            raw = await self._remove(res, key)
        return web.json_response(raw)

    async def _remove(self, res: Any, key: Any) -> dict[str, Any]:
        """Deletes a stored object (the caller holds the lock): a DELETED event with a new resourceVersion, and
        a tombstone, so that a watch from an older resourceVersion still hears of it."""
        entry = self.objects[key]
        entry.patch({"metadata": {"resourceVersion": self._next_rv()}})
        raw = entry.raw
        entry.delete()
        self._tombstones.append(raw)
        del self._tombstones[:-10000]
        await self._buses[res].put({"type": "DELETED", "object": raw})
        return raw

    async def _release(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The update that removes a Terminating object's last finalizer: MODIFIED, then the deletion."""
        res: Any = request.resource
        key: Any = (res, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise self._not_found(res, request.name)
            self.objects[key].patch(request.data)
            await self._buses[res].put({"type": "MODIFIED", "object": self.objects[key].raw})
            raw = await self._remove(res, key)
        return aiohttp.web.json_response(raw)

    async def _orphan_dependents(self, uid: str | None) -> None:
        """Removes ``uid`` from every ownerReferences list (the caller holds the lock)."""
        for (res, _, _), entry in list(self.objects.items()):
            if entry.deleted:
                continue
            refs = (entry.raw.get("metadata") or {}).get("ownerReferences") or []
            kept = [r for r in refs if r.get("uid") != uid]
            if len(kept) != len(refs):
                entry.patch({"metadata": {"ownerReferences": kept or None, "resourceVersion": self._next_rv()}})
                await self._buses[res].put({"type": "MODIFIED", "object": entry.raw})

    async def _scale(self, request: kmock.Request, dry: bool) -> aiohttp.web.StreamResponse:
        """The ``scale`` subresource: an ``autoscaling/v1`` Scale read through the CRD's scale paths (or a
        StatefulSet's/Deployment's spec.replicas, status.replicas, spec.selector); a PUT or patch of it writes
        ``spec.replicas`` back through the ordinary update path (so CRD validation applies)."""
        res: Any = request.resource
        builtin = res.group == "apps" and res.plural in opsim_semantics.BUILTIN_SCALE
        paths = opsim_semantics.BUILTIN_SCALE[res.plural] if builtin else self.scales.get(res)
        if paths is None:
            raise _bad(404, "NotFound", "the server could not find the requested resource")
        current = self._stored(res, request.namespace, request.name)
        if current is None:
            raise self._not_found(res, request.name)
        scale = opsim_semantics.scale_of(current, paths, builtin)
        if request.action == kmock.action.FETCH:
            return aiohttp.web.json_response(scale)
        if request.action != kmock.action.UPDATE:
            raise _bad(405, "MethodNotAllowed", f"{request.action} is not supported on the scale subresource")
        body = request.data
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        try:
            if request.headers.get(REPLACE) == "1":
                new = body
                sent = ((body or {}).get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
                if sent and sent != scale["metadata"].get("resourceVersion"):
                    raise _bad(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{request.name}": '
                                                "the object has been modified; please apply your changes to the "
                                                "latest version and try again")
            elif ctype == "application/json-patch+json":
                new = jsonpatch.apply_patch(scale, body, in_place=False)
            else:
                new = merge_patch(scale, body)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise _bad(422, "Invalid", f"the JSON patch could not be applied: {exc}") from exc
        replicas = ((new or {}).get("spec") or {}).get("replicas") if isinstance(new, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _bad(422, "Invalid", f'Scale.autoscaling "{request.name}" is invalid: spec.replicas: Invalid '
                                       f"value: {replicas!r}: must be greater than or equal to 0")
        inner = self._derived(request, subresource=None, data=opsim_semantics.replicas_patch(paths[0], replicas),
                              headers={"Content-Type": "application/merge-patch+json"})
        await self._handle(inner)  # admitted like any update of the object (CRD schema and CEL rules)
        if dry:
            return aiohttp.web.json_response({**scale, "spec": {"replicas": replicas}})
        stored = self._stored(res, request.namespace, request.name) or current
        return aiohttp.web.json_response(opsim_semantics.scale_of(stored, paths, builtin))

    async def _server_side_apply(self, request: kmock.Request, dry: bool) -> aiohttp.web.StreamResponse:
        """``PATCH application/apply-patch+yaml``: create-or-merge with field ownership (opsim_semantics
        .server_side_apply), then stored through the ordinary create or update path (same admission)."""
        try:
            applied = yaml.safe_load(request.body or b"")
        except yaml.YAMLError as exc:
            raise _bad(400, "BadRequest", f"error decoding YAML: {exc}") from exc
        if not isinstance(applied, dict):
            raise _bad(400, "BadRequest", "the body of an apply patch must be an object")
        manager = request.params.get("fieldManager")
        if not manager:
            raise _bad(422, "Invalid", "fieldManager: Required value: is required for apply patch")
        name = (applied.get("metadata") or {}).get("name")
        if name not in (None, request.name):
            raise _bad(400, "BadRequest", f"the name of the object ({name}) does not match the name on the URL "
                                          f"({request.name})")
        current = self._stored(request.resource, request.namespace, request.name)
        merge = merge_patch if request.resource in self.custom else strategic_merge_patch
        try:
            new = opsim_semantics.server_side_apply(current, applied, manager, request.params.get("force") == "true",
                                                    merge, _now())
        except opsim_semantics.ApplyConflict as exc:
            raise _bad(409, "Conflict", str(exc)) from exc
        new["metadata"]["name"] = request.name
        if request.namespace:
            new["metadata"]["namespace"] = request.namespace
        if current is None:
            inner = self._derived(request, action=kmock.action.CREATE, data=new,
                                  headers={"Content-Type": "application/json"})
        else:
            new["metadata"]["resourceVersion"] = current["metadata"].get("resourceVersion")
            inner = self._derived(request, data=new, headers={"Content-Type": "application/json", REPLACE: "1"})
        return await self._handle(inner)

    def _admit_custom(self, request: kmock.Request, obj: dict[str, Any],
                      old: dict[str, Any] | None) -> dict[str, Any]:
        custom = self.custom.get(request.resource)
        if custom is None:
            return obj
        kind, schema = custom
        meta = obj.get("metadata") or {}
        if request.params.get("fieldValidation") == "Strict":
            unknown = [f for f in unknown_fields(obj, schema) if not f.startswith("metadata.")]
            if unknown:
                raise _bad(400, "BadRequest",
                           f"{kind} in version \"{request.resource.version}\" cannot be handled as a {kind}: "
                           + "; ".join(f'strict decoding error: unknown field "{f}"' for f in unknown))
        stored, errors = admit_custom_resource(obj, schema, old)
        if errors:
            raise _bad(422, "Invalid", f'{kind}.{request.resource.group} "{meta.get("name")}" is invalid: '
                       + ", ".join(errors), name=meta.get("name"), kind=kind,
                       group=request.resource.group,
                       causes=[{"reason": "FieldValueInvalid", "field": f, "message": m}
                               for f, _, m in (e.partition(": ") for e in errors)])
        return stored

    def _builtin_kind(self, res: Any) -> str | None:
        info = self._info(res)
        kind = info.kind if info is not None else None
        return kind if kind in opsim_builtin.KINDS and opsim_builtin.KINDS[kind][1] == res.group else None

    def _admit_builtin(self, request: kmock.Request, kind: str, obj: dict[str, Any],
                       old: dict[str, Any] | None) -> dict[str, Any]:
        """Decoding, defaulting, quantity canonicalisation and validation of a built-in kind (opsim_builtin)."""
        try:
            return opsim_builtin.admit(self.builtin_defaults, kind, obj, old,
                                       strict=request.params.get("fieldValidation") == "Strict")
        except opsim_builtin.Refused as exc:
            raise _bad(exc.code, exc.reason, exc.message, **exc.details) from exc

    def _admit_create(self, request: kmock.Request, dry: bool = False) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        if not meta.get("name"):  # generateName: the prefix and 5 random characters, for every kind
            if not meta.get("generateName"):
                raise _bad(422, "Invalid", f'{data.get("kind") or getattr(request.resource, "plural", "")} "" is invalid: '
                                           "metadata.name: Required value: name or generateName is required")
            taken = {n for (r, ns, n), o in list(self.objects.items())
                     if r == request.resource and ns == meta.get("namespace") and not o.deleted}
            meta["name"] = opsim_semantics.generate_name(meta["generateName"], taken)
        if request.resource in self.custom:
            stored = self._admit_custom(request, data, None)
            stored.pop("status", None)
            data.clear()
            data.update(stored)
        elif (builtin := self._builtin_kind(request.resource)) is not None:
            stored = self._admit_builtin(request, builtin, data, None)
            data.clear()
            data.update(stored)
        if request.resource == kmock.resource(CRD_KEY):
            names_ = data["spec"]["names"]
            data["status"] = {"acceptedNames": names_, "storedVersions": [v["name"] for v in data["spec"]["versions"]
                                                                           if v.get("storage")],
                              "conditions": [{"type": t, "status": "True", "reason": r, "lastTransitionTime": _now(),
                                              "message": m} for t, r, m in (
                                  ("NamesAccepted", "NoConflicts", "no conflicts found"),
                                  ("Established", "InitialNamesAccepted", "the initial names have been accepted"))]}
            if not dry:
                self.register_crd(data)
        self._admit_policies(request)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if not dry:
            meta["resourceVersion"] = self._next_rv()

    def _admit_policies(self, request: kmock.Request) -> None:
        """Validating admission (Pod Security, ResourceQuota): see opsim_admission."""
        ns = request.data["metadata"].get("namespace") or ""
        labels = (self.namespaces.get(ns, {}).get("metadata") or {}).get("labels") or {}
        pods = [p for p in self.live("v1/pods") if p["metadata"].get("namespace") == ns]
        quotas = [q for q in self.live("v1/resourcequotas") if q["metadata"].get("namespace") == ns]
        same = sum(1 for (r, n, _), o in list(self.objects.items()) if r == request.resource and n == ns
                   and not o.deleted)
        opsim_admission.admit_create(request.resource, request.data, labels, pods, quotas, same)

    def _admit_update(self, request: kmock.Request, dry: bool = False) -> None:
        """PATCH (merge, strategic-merge for built-ins, JSON patch): the resulting object is computed here,
        admitted like a create (pruning, defaulting, schema and CEL validation, with ``oldSelf``), and
        handed to KMock as the merge patch from the stored object to it."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # KMock answers 404
        current = copy.deepcopy(self.objects[key].raw)
        body = request.data
        ctype = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        custom = request.resource in self.custom
        replace = request.headers.get(REPLACE) == "1"
        try:
            if replace:  # PUT: the body is the whole object; its resourceVersion, if any, must be current
                if not isinstance(body, dict):
                    raise _bad(400, "BadRequest", "the body of a PUT must be an object")
                sent = (body.get("metadata") or {}).get("resourceVersion")
                if sent and sent != (current.get("metadata") or {}).get("resourceVersion"):
                    raise _bad(409, "Conflict", f'Operation cannot be fulfilled on {request.resource.plural} '
                                                f'"{request.name}": the object has been modified; please apply '
                                                "your changes to the latest version and try again")
                new = copy.deepcopy(body)
            elif ctype == "application/json-patch+json":
                if not isinstance(body, list):
                    raise _bad(400, "BadRequest", "a JSON patch must be a list of operations")
                new = jsonpatch.apply_patch(current, body, in_place=False)
            elif ctype == "application/strategic-merge-patch+json":
                if custom:
                    raise _bad(415, "UnsupportedMediaType",
                               "the body of the request was in an unknown format - accepted media types include: "
                               "application/json-patch+json, application/merge-patch+json, "
                               "application/apply-patch+yaml")
                new = strategic_merge_patch(current, body)
            elif ctype == "application/apply-patch+yaml":
                raise _bad(415, "UnsupportedMediaType", "server-side apply is not emulated (use kubectl apply "
                                                        "without --server-side)")
            else:
                if not isinstance(body, dict):
                    raise _bad(400, "BadRequest", "a merge patch must be a JSON object")
                new = merge_patch(current, body)
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise _bad(422, "Invalid", f"the JSON patch could not be applied: {exc}") from exc
        if not isinstance(new, dict):
            raise _bad(422, "Invalid", "the patched object is not an object")
        new = copy.deepcopy(new)  # a merge patch shares the parts it leaves alone with ``current``
        cur_meta = current.get("metadata") or {}
        meta = new.get("metadata") if isinstance(new.get("metadata"), dict) else {}
        expected = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("uid")
        if expected and expected != cur_meta.get("uid"):
            raise _bad(409, "Conflict", f"Precondition failed: UID in precondition: {expected}, "
                                        f"UID in object meta: {cur_meta.get('uid')}")
        # A patch that names a resourceVersion is an update conditional on it (optimistic concurrency).
        sent_rv = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
        if sent_rv and not replace and sent_rv != cur_meta.get("resourceVersion"):
            raise _bad(409, "Conflict", f'Operation cannot be fulfilled on {request.resource.plural} '
                                        f'"{request.name}": the object has been modified; please apply your '
                                        "changes to the latest version and try again")
        for field in ("uid", "name", "namespace", "creationTimestamp", "generation", "deletionTimestamp"):
            if field in cur_meta:
                meta[field] = cur_meta[field]
            else:
                meta.pop(field, None)
        new["metadata"] = meta
        info = self._info(request.resource)
        if request.subresource == "status":
            new = {**current, "status": new.get("status")} if "status" in new else dict(current)
            new["metadata"] = dict(cur_meta)
        elif request.subresource is None and info is not None and "status" in info.subresources:
            new.pop("status", None)  # the status subresource owns status
            if "status" in current:
                new["status"] = current["status"]
        if custom:
            new = self._admit_custom(request, new, current)  # a new object: its metadata is a copy
            meta = new["metadata"]
        elif request.subresource is None and (builtin := self._builtin_kind(request.resource)) is not None:
            new = self._admit_builtin(request, builtin, new, current)
            meta = new["metadata"]
        if request.resource == kmock.resource(CRD_KEY) and request.subresource is None and not dry:
            self.register_crd(new)
        changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                  {k: v for k, v in current.items() if k not in ("metadata", "status")}
        if changed:
            meta["generation"] = int(cur_meta.get("generation") or 1) + 1
        if not dry:
            meta["resourceVersion"] = self._next_rv()
        object.__setattr__(request, "data", merge_diff(current, new))

    def live(self, plural_key: str) -> list[dict[str, Any]]:
        """Current objects of one resource (e.g. ``v1/pods``), as plain dicts."""
        res = kmock.resource(plural_key)
        return [copy.deepcopy(obj.raw) for (r, _, _), obj in list(self.objects.items())
                if r == res and not obj.deleted]


def object_path(res: Any, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if res.group == "" else f"/apis/{res.group}/{res.version}"
    out = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{res.plural}"
    return out + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


async def collect_garbage(server: ApiServer, http: aiohttp.ClientSession, period: float = 0.2) -> None:
    """kube-controller-manager's garbage collector: deletes (in the background) dependents whose owners are
    all gone; for an owner deleted in the foreground (finalizer ``foregroundDeletion``) deletes its dependents
    (in the foreground too) and removes the finalizer once none with ``blockOwnerDeletion`` is left."""
    while True:
        await asyncio.sleep(period)
        items = [(k, o.raw) for k, o in list(server.objects.items()) if not o.deleted]
        uids = {raw.get("metadata", {}).get("uid") for _, raw in items}
        for (res, ns, name), raw in items:
            meta = raw.get("metadata", {})
            refs = meta.get("ownerReferences") or []
            if refs and not any(ref.get("uid") in uids for ref in refs):
                await _gc_delete(http, object_path(res, ns, name), "Background")
            if meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or []):
                blocking = False
                for (dres, dns, dname), dep in items:
                    owned = [r for r in dep.get("metadata", {}).get("ownerReferences") or []
                             if r.get("uid") == meta.get("uid")]
                    if owned:
                        blocking = blocking or any(r.get("blockOwnerDeletion") for r in owned)
                        if not dep["metadata"].get("deletionTimestamp"):
                            await _gc_delete(http, object_path(dres, dns, dname), "Foreground")
                if not blocking:
                    rest = [f for f in meta.get("finalizers") or [] if f != "foregroundDeletion"]
                    async with http.patch(object_path(res, ns, name), json={"metadata": {
                            "uid": meta.get("uid"), "finalizers": rest}},
                            headers={"Content-Type": "application/merge-patch+json"}) as resp:
                        await resp.read()


async def _gc_delete(http: aiohttp.ClientSession, url: str, policy: str) -> None:
    async with http.delete(url, json={"kind": "DeleteOptions", "apiVersion": "v1",
                                      "propagationPolicy": policy}) as resp:
        await resp.read()  # 404: gone already


# ---------------------------------------------------------------------------------------------- kubelet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.define
class _Container:
    uid: str
    namespace: str
    name: str
    process: asyncio.subprocess.Process | None = None
    log: Path | None = None
    deleted: bool = False


class LocalKubelet:
    """Runs every Pod in the emulator as a local process and reports its phase back (see module docstring)."""

    def __init__(self, server: ApiServer, http: aiohttp.ClientSession, api_url: str, root: Path,
                 command_map: dict[str, list[str]] | None = None, period: float = 0.1) -> None:
        self.server = server
        self.http = http
        self.api_url = api_url
        self.root = root
        self.command_map = {"grstack": [str(VENV_BIN / "grstack")], **(command_map or {})}
        self.period = period
        self.enabled = True  # False: pods stay Pending (nothing is run)
        self.containers: dict[str, _Container] = {}
        self.ports: dict[tuple[str, str, str], int] = {}
        self.network = opsim_controllers.PodNetwork(server)  # container ports and Service addresses, made local
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        try:
            while True:
                self._sync()
                await asyncio.sleep(self.period)
        finally:
            for c in self.containers.values():
                self._signal(c, signal.SIGKILL)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _sync(self) -> None:
        pods = {p["metadata"]["uid"]: p for p in self.server.live("v1/pods")}
        for uid, c in self.containers.items():
            gone = uid not in pods or bool(pods[uid]["metadata"].get("deletionTimestamp"))
            if gone and not c.deleted:
                c.deleted = True
                self._signal(c, signal.SIGTERM)
                task = asyncio.create_task(self._reap(c))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        for uid, pod in pods.items():
            if self.enabled and uid not in self.containers and not pod["metadata"].get("deletionTimestamp"):
                c = _Container(uid=uid, namespace=pod["metadata"]["namespace"], name=pod["metadata"]["name"])
                self.containers[uid] = c
                task = asyncio.create_task(self._run_pod(c, pod))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def pod(self, name: str, namespace: str = "default") -> _Container:
        live = [c for c in self.containers.values() if c.name == name and c.namespace == namespace
                and not c.deleted]
        if not live:
            raise KeyError(f"no running pod {namespace}/{name}")
        return live[-1]

    def kill(self, name: str, namespace: str = "default") -> None:
        """SIGKILL the pod's process (a crashed worker: the pod goes Failed with exit status 137)."""
        self._signal(self.pod(name, namespace), signal.SIGKILL)

    def logs(self, name: str, namespace: str = "default") -> str:
        cs = [c for c in self.containers.values() if c.name == name and c.namespace == namespace and c.log]
        return "\n".join(c.log.read_text(errors="replace") for c in cs if c.log.exists())

    @staticmethod
    def _signal(c: _Container, sig: int) -> None:
        if c.process is not None and c.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.process.pid, sig)

    async def _reap(self, c: _Container) -> None:
        if c.process is None:
            return
        try:
            await asyncio.wait_for(c.process.wait(), timeout=5)
        except TimeoutError:
            self._signal(c, signal.SIGKILL)
            await c.process.wait()

    async def _patch_status(self, c: _Container, status: dict[str, Any]) -> None:
        body = {"metadata": {"uid": c.uid}, "status": status}
        url = f"/api/v1/namespaces/{c.namespace}/pods/{c.name}/status"
        async with self.http.patch(url, json=body, headers={"Content-Type": "application/merge-patch+json"}) as r:
            await r.read()  # 404/409: the pod is gone or was replaced; nothing to report

    async def _run_pod(self, c: _Container, pod: dict[str, Any]) -> None:
        pod_dir = self.root / "pods" / c.uid
        container = pod["spec"]["containers"][0]
        while True:  # ContainerCreating: wait for the ConfigMaps the volumes need
            if c.deleted:
                return
            mounts = self._volumes(pod, container, pod_dir)
            if mounts is not None:
                break
            await asyncio.sleep(self.period)
        env = self._env(pod, container, mounts)
        argv = [self._rewrite(_expand(a, env), mounts) for a in container.get("command", [])]
        argv += [self._rewrite(_expand(a, env), mounts) for a in container.get("args", [])]
        while (local := self.network.rewrite_args(pod, argv)) is None:  # a Service it names has no endpoint yet
            if c.deleted:
                return
            await asyncio.sleep(self.period)
        argv = self.command_map.get(local[0], [local[0]]) + local[1:]
        c.log = pod_dir / "container.log"
        c.log.parent.mkdir(parents=True, exist_ok=True)
        with c.log.open("wb") as out:
            c.process = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=pod_dir, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        if c.deleted:  # deleted while it was being started: _sync signalled no process, so stop it here
            self._signal(c, signal.SIGKILL)
            await c.process.wait()
            return
        started = _now()
        probed = "readinessProbe" in container  # then Ready only once the probe answers
        await self._patch_status(c, self._running(container, started, not probed))
        prober = asyncio.create_task(self._probe(c, pod, container, started)) if probed else None
        code = await c.process.wait()
        if prober is not None:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
        if c.deleted:
            return
        exit_code = code if code >= 0 else 128 - code
        tail = c.log.read_bytes()[-2048:].decode(errors="replace") if exit_code else ""
        await self._patch_status(c, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": _now()}],
            "containerStatuses": [{"name": container["name"], "ready": False, "restartCount": 0,
                                   "image": container.get("image", ""), "imageID": "",
                                   "state": {"terminated": {
                                       "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                       "message": tail, "startedAt": started, "finishedAt": _now()}}}]})

    @staticmethod
    def _running(container: dict[str, Any], started: str, ready: bool) -> dict[str, Any]:
        return {"phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": started,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": _now()}],
                "containerStatuses": [{"name": container["name"], "ready": ready, "restartCount": 0,
                                       "image": container.get("image", ""), "imageID": "",
                                       "state": {"running": {"startedAt": started}}}]}

    async def _probe(self, c: _Container, pod: dict[str, Any], container: dict[str, Any], started: str) -> None:
        """The readinessProbe, polled until the process ends; the Ready condition follows its answer."""
        ready = False
        while not c.deleted:
            ok = await self.network.probe(pod, container)
            if ok != ready:
                ready = ok
                await self._patch_status(c, self._running(container, started, ready))
            await asyncio.sleep(0.3)

    def _volumes(self, pod: dict[str, Any], container: dict[str, Any], pod_dir: Path) -> list[tuple[str, str]] | None:
        """(mountPath, local dir) pairs, longest mount path first; None while a ConfigMap is missing."""
        ns = pod["metadata"]["namespace"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out = []
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "persistentVolumeClaim" in vol:
                local = self.root / "pvc" / ns / vol["persistentVolumeClaim"]["claimName"]
            else:
                local = pod_dir / "volumes" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol:
                cms = [o for o in self.server.live("v1/configmaps")
                       if o["metadata"]["namespace"] == ns and o["metadata"]["name"] == vol["configMap"]["name"]]
                if not cms:
                    return None
                for key, text in (cms[0].get("data") or {}).items():
                    (local / key).write_text(text)
            out.append((m["mountPath"].rstrip("/"), str(local)))
        return sorted(out, key=lambda pair: -len(pair[0]))

    def _env(self, pod: dict[str, Any], container: dict[str, Any], mounts: list[tuple[str, str]]) -> dict[str, str]:
        meta = pod["metadata"]
        env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "GRSTACK_KUBE_API": self.api_url}
        fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "status.podIP": "127.0.0.1", "spec.nodeName": "local"}
        subdomain = pod["spec"].get("subdomain")
        for item in container.get("env", []):
            if "value" in item:
                value = _expand(item["value"], env)
            else:
                value = fields.get(item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath"), "")
            env[item["name"]] = self._rewrite(value, mounts)
        if subdomain and env.get("MASTER_ADDR", "").endswith(f".{subdomain}"):
            env["MASTER_ADDR"] = "127.0.0.1"
            # One port per gang incarnation: a dying pod of the previous attempt must not hold the new one's
            # rendezvous port (in a cluster each pod has its own IP).
            key = (meta["namespace"], subdomain, meta.get("labels", {}).get("grstack.io/attempt", ""))
            env["MASTER_PORT"] = str(self.ports.setdefault(key, free_port()))
        return env

    @staticmethod
    def _rewrite(value: str, mounts: list[tuple[str, str]]) -> str:
        prefix, _, path = value.rpartition("=") if value.startswith("--") else ("", "", value)
        for mount, local in mounts:
            if path == mount or path.startswith(mount + "/"):
                path = local + path[len(mount):]
                break
        return f"{prefix}={path}" if prefix else path


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


# ----------------------------------------------------------------------------------------------- cluster


class OperatorProcess:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path, liveness: str, metrics: str) -> None:
        self.proc = proc
        self.log = log
        self.liveness = liveness
        self.metrics_url = metrics

    async def get(self, url: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return resp.status, await resp.text()

    async def wait_live(self, timeout: float = 120) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()}")
            with contextlib.suppress(aiohttp.ClientError):
                if (await self.get(self.liveness))[0] == 200:
                    return
            await asyncio.sleep(0.2)
        raise AssertionError(f"operator not live:\n{self.log.read_text()}")

    async def metrics(self) -> str:
        return (await self.get(self.metrics_url))[1]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=30)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()


class Cluster:
    """The emulated API server + garbage collector + kubelet (+ the operator, when started)."""

    def __init__(self, server: ApiServer, url: str, http: aiohttp.ClientSession, kubelet: LocalKubelet,
                 root: Path) -> None:
        self.server = server
        self.url = url
        self.http = http
        self.kubelet = kubelet
        self.root = root
        self.op: OperatorProcess | None = None
        self.controllers: opsim_controllers.Controllers | None = None  # with start(controllers=True)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, root: Path, command_map: dict[str, list[str]] | None = None,
                    controllers: bool = False) -> AsyncIterator[Cluster]:
        """``controllers``: also run the StatefulSet, Deployment and HPA controllers (opsim_controllers); off,
        those objects get no pods and their status is whatever a test writes."""
        async with ApiServer() as server, kmock.Server(server) as srv:
            url = str(srv.url).rstrip("/")
            async with aiohttp.ClientSession(url) as http:
                kubelet = LocalKubelet(server, http, url, root, command_map)
                tasks = [asyncio.create_task(kubelet.run()), asyncio.create_task(collect_garbage(server, http))]
                cluster = cls(server, url, http, kubelet, root)
                if controllers:
                    cluster.controllers = opsim_controllers.Controllers(server, http)
                    tasks.append(asyncio.create_task(cluster.controllers.run()))
                try:
                    yield cluster
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def operator(self, resync_seconds: float = 1.0, extra_args: Sequence[str] = (),
                       log_name: str = "operator.log") -> AsyncIterator[OperatorProcess]:
        """``grstack operator`` as a process logged in to the emulator (kopf owns its event loop: it cancels
        every task it did not start, so it cannot share the test's loop). Several may run at once (peering),
        each with its own ``log_name``; ``self.op`` is the last one started."""
        liveness, metrics = free_port(), free_port()
        log = self.root / log_name
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                str(VENV_BIN / "grstack"), "operator", "--server", self.url, "--resync-seconds", str(resync_seconds),
                "--liveness-port", str(liveness), "--metrics-port", str(metrics), "--all-namespaces", *extra_args,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        op = OperatorProcess(proc, log, f"http://127.0.0.1:{liveness}/healthz", f"http://127.0.0.1:{metrics}/metrics")
        try:
            await op.wait_live()
            self.op = op
            yield op
        finally:
            await op.stop()

    def write_kubeconfig(self, path: Path, namespace: str | None = "default") -> Path:
        """A kubeconfig for the real kubectl (and clients) pointing at this emulator, written to ``path``."""
        context: dict[str, Any] = {"cluster": "kmock", "user": "kmock"}
        if namespace is not None:
            context["namespace"] = namespace
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock"}}],
            "contexts": [{"name": "kmock", "context": context}]}))
        return path

    # -- client helpers ---------------------------------------------------------------------------------
    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.http.request(method, path, json=body, headers=headers) as resp:
            text = await resp.text()
            return resp.status, (yaml.safe_load(text) if text else {})

    async def apply(self, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        res = kmock.resource(_plural_key(obj))
        ns = obj["metadata"].setdefault("namespace", "default")
        return await self.request("POST", object_path(res, ns), obj)

    async def patch(self, plural_key: str, name: str, body: dict[str, Any], sub: str | None = None,
                    namespace: str = "default") -> tuple[int, dict[str, Any]]:
        return await self.request("PATCH", object_path(kmock.resource(plural_key), namespace, name, sub), body)

    async def delete(self, plural_key: str, name: str, namespace: str = "default") -> tuple[int, dict[str, Any]]:
        return await self.request("DELETE", object_path(kmock.resource(plural_key), namespace, name))

    def get(self, plural_key: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        for obj in self.server.live(plural_key):
            if obj["metadata"]["name"] == name and obj["metadata"].get("namespace") == namespace:
                return obj
        return None

    def states(self, plural_key: str, name: str, namespace: str = "default") -> list[str]:
        """The distinct ``status.state`` values an object went through, in order (from KMock's history)."""
        key = (kmock.resource(plural_key), namespace, name)
        out: list[str] = []
        for version in self.server.objects[key].history:
            state = ((version.raw if version is not None else {}).get("status") or {}).get("state")
            if state and (not out or out[-1] != state):
                out.append(state)
        return out

    def pods(self, label: str, value: str) -> list[dict[str, Any]]:
        return [p for p in self.server.live("v1/pods") if p["metadata"].get("labels", {}).get(label) == value]

    async def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float = 60) -> Any:
        """Polls until ``predicate()`` is truthy; fails naming ``what`` (no timing is asserted)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)


def _plural_key(obj: dict[str, Any]) -> str:
    api = obj["apiVersion"]
    for key, (kind, *_) in CORE.items():
        if kind == obj["kind"] and key.startswith(api + "/"):
            return key
    for res in crds.RESOURCES:
        if res.kind == obj["kind"]:
            return f"{crds.GROUP}/{crds.VERSION}/{res.plural}"
    raise KeyError(obj["kind"])


async def _serve(kubeconfig: Path) -> None:
    """An emulated cluster for trying things by hand or dry-running the ``cluster`` suite against it."""
    import tempfile

    async with Cluster.start(Path(tempfile.mkdtemp(prefix="grstack-kmock-"))) as c:
        c.write_kubeconfig(kubeconfig, namespace=None)
        print(f"emulated cluster at {c.url}; KUBECONFIG={kubeconfig}; pods run here under {c.root}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=_serve.__doc__)
    parser.add_argument("--kubeconfig", type=Path, default=Path("kmock.kubeconfig"))
    asyncio.run(_serve(parser.parse_args().kubeconfig))

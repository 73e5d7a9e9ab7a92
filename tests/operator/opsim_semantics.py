"""API-server semantics the emulator (opsim.py) needs beyond storing objects, kept apart from its HTTP glue:
Kubernetes JSONPath (printer columns and field selectors), ``generateName``, the ``autoscaling/v1`` Scale
view of an object, and server-side apply's field ownership (``managedFields`` in ``FieldsV1``).

Each follows kube-apiserver's observable behaviour for the requests the real clients here send; what is
simplified is said where it is.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Iterator
from typing import Any

# ------------------------------------------------------------------------------------------------ JSONPath

_TOKEN = re.compile(r"""
    \.\.(?P<descend>[\w\-/]+|\*)            # ..name, ..*
  | \.(?P<field>[\w\-/]+|\*)                # .name, .*
  | \[\s*(?P<index>-?\d+)\s*\]              # [0], [-1]
  | \[\s*(?P<start>-?\d*)\s*:\s*(?P<stop>-?\d*)\s*\]   # [1:3]
  | \[\s*\*\s*\]                            # [*]
  | \[\s*'(?P<quoted1>[^']*)'\s*\]          # ['a.b']
  | \[\s*"(?P<quoted2>[^"]*)"\s*\]          # ["a.b"]
  | \[\s*\?\((?P<filter>.*?)\)\s*\]         # [?(@.type=="Ready")]
""", re.X)
_FILTER = re.compile(r"^@(?P<path>(?:\.[\w\-/]+|\[\d+\])*)\s*(?:(?P<op>==|!=|<=|>=|<|>)\s*(?P<value>.+?))?\s*$")


class JsonPathError(ValueError):
    """A path outside the subset (the API server would reject the CRD or selector)."""


def _steps(path: str) -> list[tuple[str, Any]]:
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    if path and not path.startswith((".", "[")):
        path = "." + path
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if m is None:
            raise JsonPathError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos = m.end()
        if m.group("descend") is not None:
            out.append(("descend", m.group("descend")))
        elif m.group("field") is not None:
            out.append(("field", m.group("field")))
        elif m.group("index") is not None:
            out.append(("index", int(m.group("index"))))
        elif m.group("stop") is not None or m.group("start") is not None:
            out.append(("slice", (m.group("start"), m.group("stop"))))
        elif m.group("quoted1") is not None or m.group("quoted2") is not None:
            out.append(("field", m.group("quoted1") if m.group("quoted1") is not None else m.group("quoted2")))
        elif m.group("filter") is not None:
            f = _FILTER.match(m.group("filter"))
            if f is None:
                raise JsonPathError(f"unsupported JSONPath filter {m.group('filter')!r}")
            out.append(("filter", (_steps(f.group("path")), f.group("op"), _literal(f.group("value")))))
        else:
            out.append(("field", "*"))
    return out


def _literal(text: str | None) -> Any:
    if text is None:
        return None
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    try:
        return json.loads(text)
    except ValueError as exc:
        raise JsonPathError(f"unsupported JSONPath literal {text!r}") from exc


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node.values())
    if isinstance(node, list):
        return list(node)
    return []


def _descendants(node: Any) -> Iterator[Any]:
    yield node
    for child in _children(node):
        yield from _descendants(child)


def _compare(left: Any, op: str, right: Any) -> bool:
    if op == "==":
        return bool(left == right)
    if op == "!=":
        return bool(left != right)
    if isinstance(left, bool) or isinstance(right, bool) or not isinstance(left, int | float) \
            or not isinstance(right, int | float):
        return False  # ordering is for numbers only
    return bool({"<": left < right, ">": left > right, "<=": left <= right, ">=": left >= right}[op])


def _apply(nodes: list[Any], steps: list[tuple[str, Any]]) -> list[Any]:
    for kind, arg in steps:
        out: list[Any] = []
        for node in nodes:
            if kind == "field":
                if arg == "*":
                    out += _children(node)
                elif isinstance(node, dict) and arg in node:
                    out.append(node[arg])
            elif kind == "descend":
                for d in _descendants(node):
                    out += _children(d) if arg == "*" else ([d[arg]] if isinstance(d, dict) and arg in d else [])
            elif kind == "index":
                if isinstance(node, list) and -len(node) <= arg < len(node):
                    out.append(node[arg])
            elif kind == "slice":
                if isinstance(node, list):
                    start, stop = (int(v) if v else None for v in arg)
                    out += node[start:stop]
            elif kind == "filter":
                sub, op, value = arg
                for item in node if isinstance(node, list) else []:
                    found = _apply([item], sub)
                    if op is None:
                        if found:
                            out.append(item)
                    elif found and _compare(found[0], op, value):
                        out.append(item)
        nodes = out
    return nodes


def find(obj: Any, path: str) -> list[Any]:
    """Every value the Kubernetes JSONPath ``path`` selects (the subset printer columns and field selectors
    use: fields, quoted keys, indexes, slices, ``*``, ``..`` and ``[?(@.a == "x")]`` filters)."""
    return _apply([obj], _steps(path))


def first(obj: Any, path: str) -> Any:
    """The first value (what a printer column shows: kube-apiserver's table convertor takes ``results[0][0]``)."""
    found = find(obj, path)
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------- generateName

# k8s.io/apimachinery's utilrand alphabet: no vowels (no words), no confusable 0/1/3.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def generate_name(prefix: str, taken: set[str], rng: random.Random | None = None) -> str:
    """``generateName`` + 5 random characters, as kube-apiserver's SimpleNameGenerator (retrying on a clash,
    where the server would answer 409 and the client retry)."""
    pick = rng or random.SystemRandom()
    for _ in range(100):
        name = prefix[:58] + "".join(pick.choice(_NAME_ALPHABET) for _ in range(5))
        if name not in taken:
            return name
    raise RuntimeError("no free generated name")  # 27^5 names: unreachable in tests


# ----------------------------------------------------------------------------------------------------- Scale


def selector_string(selector: Any) -> str:
    """A LabelSelector (``matchLabels``/``matchExpressions``) in its string form, as Scale.status.selector."""
    if isinstance(selector, str):
        return selector
    if not isinstance(selector, dict):
        return ""
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, key, values = expr.get("operator"), expr.get("key"), ",".join(expr.get("values") or [])
        terms.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key,
                      "DoesNotExist": f"!{key}"}.get(op, ""))
    return ",".join(t for t in terms if t)


# resource plural -> (specReplicasPath, statusReplicasPath, labelSelectorPath) of the built-in scalable kinds
# (their selector is spec.selector, a LabelSelector, not a string at a path)
BUILTIN_SCALE = {"statefulsets": (".spec.replicas", ".status.replicas", None),
                 "deployments": (".spec.replicas", ".status.replicas", None)}


def scale_of(obj: dict[str, Any], paths: tuple[str, str, str | None], builtin: bool) -> dict[str, Any]:
    """The ``autoscaling/v1`` Scale of an object, read through its scale subresource's paths."""
    spec_path, status_path, selector_path = paths
    meta = obj.get("metadata") or {}
    replicas = first(obj, spec_path)
    selector: Any
    if builtin:
        replicas = 1 if replicas is None else replicas
        selector = selector_string((obj.get("spec") or {}).get("selector"))
    else:
        selector = first(obj, selector_path) if selector_path else None
    status: dict[str, Any] = {"replicas": int(first(obj, status_path) or 0)}
    if selector:
        status["selector"] = selector
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": int(replicas or 0)}, "status": status}


def replicas_patch(spec_path: str, replicas: int) -> dict[str, Any]:
    """The merge patch that writes a Scale's ``spec.replicas`` back to the object."""
    parts = [p for p in spec_path.split(".") if p]
    patch: dict[str, Any] = {}
    node = patch
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = replicas
    return patch


# ------------------------------------------------------------------------------------------ server-side apply

Path_ = tuple[str, ...]
_NOT_OWNED = {("apiVersion",), ("kind",), ("status",)} | {("metadata", k) for k in (
    "name", "namespace", "uid", "resourceVersion", "creationTimestamp", "generation", "managedFields",
    "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink")}


class ApplyConflict(Exception):
    """Fields another manager owns with a different value (the API server's 409 without ``force``)."""


def field_paths(obj: Any, prefix: Path_ = ()) -> set[Path_]:
    """The leaf fields an applied configuration sets (lists are atomic, as for a CRD list without
    ``x-kubernetes-list-type: map``; built-in list-maps are simplified to atomic too)."""
    if isinstance(obj, dict) and obj:
        out: set[Path_] = set()
        for key, value in obj.items():
            path = (*prefix, key)
            if path[:1] == ("status",) or path in _NOT_OWNED:
                continue
            out |= field_paths(value, path)
        return out
    return {prefix} if prefix else set()


def fields_v1(paths: set[Path_]) -> dict[str, Any]:
    """``FieldsV1`` (``{"f:spec": {"f:replicas": {}}}``) of a set of leaf paths."""
    out: dict[str, Any] = {}
    for path in sorted(paths):
        node = out
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return out


def paths_of(fields: Any, prefix: Path_ = ()) -> set[Path_]:
    if not isinstance(fields, dict) or not fields:
        return {prefix} if prefix else set()
    out: set[Path_] = set()
    for key, sub in fields.items():
        if key.startswith("f:"):
            out |= paths_of(sub, (*prefix, key[2:]))
    return out or ({prefix} if prefix else set())


def _get(obj: Any, path: Path_) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return _ABSENT
        obj = obj[part]
    return obj


_ABSENT = object()


def _remove(obj: dict[str, Any], path: Path_) -> None:
    node: Any = obj
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


def server_side_apply(current: dict[str, Any] | None, applied: dict[str, Any], manager: str, force: bool,
                      merge: Any, now: str) -> dict[str, Any]:
    """The object after ``manager`` applies ``applied`` (``PATCH application/apply-patch+yaml``): merged into
    the live object (``merge(live, patch)``: strategic for built-ins, JSON merge for custom resources); the
    fields this manager set before and no longer sets are removed unless another manager owns them; a field
    another Apply manager owns with a different value is a conflict unless ``force`` (then it changes hands;
    a field applied with the value it has is shared).
    ``managedFields`` records each manager's fields. Fields written by plain patches are not tracked
    (kube-apiserver records them under an Update manager, so its conflicts are a superset of these)."""
    live = copy.deepcopy(current or {})
    entries = [e for e in (live.get("metadata") or {}).get("managedFields") or [] if isinstance(e, dict)]
    mine = field_paths(applied)
    owned = {id(e): paths_of(e.get("fieldsV1")) for e in entries}
    previous = set().union(*(owned[id(e)] for e in entries if e.get("manager") == manager
                             and e.get("operation") == "Apply")) if entries else set()
    conflicts: list[tuple[Any, Path_]] = []
    for e in entries:
        if e.get("manager") == manager or e.get("operation") != "Apply":
            continue
        for path in sorted(owned[id(e)] & mine):
            if _get(live, path) != _get(applied, path):
                conflicts.append((e.get("manager"), path))
    if conflicts and not force:
        raise ApplyConflict(f"Apply failed with {len(conflicts)} conflict{'s' if len(conflicts) > 1 else ''}: "
                            + "; ".join(f'conflict with "{m}": .{".".join(p)}' for m, p in conflicts))
    body = copy.deepcopy(applied)
    meta = body.get("metadata") or {}
    body["metadata"] = {k: v for k, v in meta.items() if k in ("labels", "annotations", "finalizers",
                                                                "ownerReferences")}
    body.pop("status", None)
    new = merge(live, body) if current is not None else copy.deepcopy(applied)
    others = set().union(*(owned[id(e)] for e in entries if e.get("manager") != manager)) if entries else set()
    for path in sorted(previous - mine - others, key=len, reverse=True):
        _remove(new, path)
    kept = []
    for e in entries:
        if e.get("manager") == manager and e.get("operation") == "Apply":
            continue
        taken = {path for m, path in conflicts if m == e.get("manager")}  # forced away; equal values are shared
        rest = owned[id(e)] - taken
        if rest:
            kept.append({**e, "fieldsV1": fields_v1(rest)})
    kept.append({"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion", ""),
                 "time": now, "fieldsType": "FieldsV1", "fieldsV1": fields_v1(mine)})
    new.setdefault("metadata", {})["managedFields"] = kept
    return new

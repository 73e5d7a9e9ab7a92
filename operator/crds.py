"""CustomResourceDefinitions generated from the pydantic models (``models.py`` is the single source).

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3 schema: no ``$ref``, no
``anyOf`` except the int-or-string idiom, boolean ``exclusiveMinimum``, an explicit type everywhere (or
``x-kubernetes-preserve-unknown-fields``). Nested objects with defaults get ``default: {}`` so the API
server fills in their defaults even when the user leaves the whole section out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from grstack.operator import models, names
from grstack.operator.names import (
    GROUP,
    SERVING_KIND,
    SERVING_PLURAL,
    TRAINING_KIND,
    TRAINING_PLURAL,
    VERSION,
)

_DROP = {"title", "$defs"}


@dataclass(frozen=True)
class Resource:
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[dict[str, Any], ...]
    scale: bool = False


TRAINING = Resource(
    kind=TRAINING_KIND, plural=TRAINING_PLURAL, singular="grtrainingjob", short_names=("grtj",),
    spec=models.GRTrainingJobSpec, status=models.GRTrainingJobStatus,
    columns=(
        {"name": "State", "type": "string", "jsonPath": ".status.state"},
        {"name": "Workers", "type": "integer", "jsonPath": ".status.workers.active",
         "description": "active worker pods"},
        {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
        {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ),
)

SERVING = Resource(
    kind=SERVING_KIND, plural=SERVING_PLURAL, singular="grrankingservice", short_names=("grrs",),
    spec=models.GRRankingServiceSpec, status=models.GRRankingServiceStatus,
    columns=(
        {"name": "URL", "type": "string", "jsonPath": ".status.url"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "ready ranker replicas"},
        {"name": "HitRate", "type": "number", "jsonPath": ".status.cacheHitRate"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ),
    scale=True,
)

RESOURCES = (TRAINING, SERVING)


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's validation schema as a structural OpenAPI v3 schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}))


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    if node.get("x-kubernetes-int-or-string"):
        return {k: v for k, v in node.items() if k not in _DROP}
    if "anyOf" in node:  # Optional[X]: the API server treats an absent field as null already
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} structurally")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        return _convert({**_resolve(branches[0], defs), **rest}, defs)

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _property(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _convert(value, defs)
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:
                out[key] = _convert(value, defs)
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    if "properties" in out:
        out["type"] = "object"
        out.pop("additionalProperties", None)  # extra="forbid": the API server prunes unknown fields
    return out


def _property(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    resolved = _resolve(node, defs)
    converted = _convert(node, defs)
    # A defaulted section (default_factory) that the user omits: default to {} so nested defaults apply.
    omittable = not resolved.get("required") and "anyOf" not in resolved
    if converted.get("type") == "object" and "properties" in converted and "default" not in converted and omittable:
        converted["default"] = {}
    return converted


# Only name and generateName may be declared under metadata. Declaring both (with name's maxLength) makes
# the API server type them for CEL as declared, so the rules below are cheap enough to pass its cost check.
METADATA_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": names.MAX_NAME_LENGTH}, "generateName": {"type": "string"}}}
# The API server checks a custom resource's name only as a DNS subdomain ("demo.v2" and "1demo" pass), but
# the operator names Services and pod hostnames after it.
NAME_RULES = [
    {"rule": f"self.metadata.name.matches('{names.DNS_1035_PATTERN}')",
     "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
                "letter and ending with a letter or digit): the operator names Services and pod hostnames "
                "after it"},
    {"rule": f"size(self.metadata.name) <= {names.MAX_NAME_LENGTH}",
     "message": f"metadata.name must be at most {names.MAX_NAME_LENGTH} characters: the names the operator "
                f"derives from it (<name>-ranker-<hash>, <name>-worker-<rank>) must fit in "
                f"{names.DNS_LABEL_MAX}"},
]


def crd(resource: Resource) -> dict[str, Any]:
    """The CustomResourceDefinition object for one resource."""
    spec_schema = structural_schema(resource.spec)
    spec_schema.setdefault("description", f"Desired state of the {resource.kind}.")
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": METADATA_SCHEMA,
            "spec": spec_schema,
            "status": structural_schema(resource.status),
        },
        "x-kubernetes-validations": NAME_RULES,
    }
    subresources: dict[str, Any] = {"status": {}}
    if resource.scale:
        subresources["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{resource.plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": ["grstack"],
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": subresources,
                "additionalPrinterColumns": [dict(c) for c in resource.columns],
            }],
        },
    }


HEADER = "# Generated by `grstack crds` from grstack.operator.models; do not edit by hand.\n"


def render(resource: Resource) -> str:
    return HEADER + yaml.safe_dump(crd(resource), sort_keys=False, width=100)


def peering_crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    """kopf's peering resources (leader election among operator replicas: ``grstack operator --peering``)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": plural[:-1]},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }


PEERING = (("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"), ("KopfPeering", "kopfpeerings", "Namespaced"))


def rendered_files() -> dict[str, str]:
    """File name -> YAML text for every CRD (what ``grstack crds --out DIR`` writes): the two grstack.io
    resources and kopf's two peering resources (operator replicas elect a leader through them)."""
    out = {f"{r.plural}.{GROUP}.yaml": render(r) for r in RESOURCES}
    for kind, plural, scope in PEERING:
        out[f"{plural}.kopf.dev.yaml"] = HEADER.replace("grstack.operator.models", "kopf's peering") + \
            yaml.safe_dump(peering_crd(kind, plural, scope), sort_keys=False, width=100)
    return out

"""The generated CRDs: current on disk, structural, valid CustomResourceDefinitions, and enforcing the rules
users rely on (checked by running manifests through the same pruning/defaulting/validation as the API server).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from opsim import REPO, admit_custom_resource

from grstack.operator import crds, names
from grstack.operator.models import GRRankingServiceSpec, GRTrainingJobSpec

pytestmark = pytest.mark.unit

KUBE_VERSIONS = ("1.27", latest_version())


def schema(resource: crds.Resource) -> dict[str, Any]:
    return crds.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("directory", ["crds", "charts/grstack/crds"])
def test_crd_files_are_current(directory: str) -> None:
    expected = crds.rendered_files()
    folder = REPO / directory
    on_disk = {p.name: p.read_text() for p in folder.glob("*.yaml")}
    assert on_disk == expected, (f"{directory}/ is stale: run `grstack crds --out crds/ "
                                 f"--out charts/grstack/crds/`")


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
def test_crd_is_a_valid_customresourcedefinition(resource: crds.Resource, version: str) -> None:
    kubernetes_validate.validate(crds.crd(resource), version, strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
def test_schema_is_structural(resource: crds.Resource) -> None:
    """Kubernetes' structural-schema rules: a type everywhere, no references, anyOf only as int-or-string at a
    node; junctors (allOf/anyOf/not, as in the checkpoint's two forms) only as value validations: no type,
    description, default, nullable, additionalProperties, properties or items inside them."""
    def junctor_free(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert not {"type", "description", "default", "nullable", "additionalProperties", "properties",
                        "items", "$ref"} & node.keys(), path
            for key in ("allOf", "anyOf", "oneOf"):
                for branch in node.get(key, []):
                    junctor_free(branch, path)
            if "not" in node:
                junctor_free(node["not"], path)

    for path, node in _walk(schema(resource)):
        assert not {"$ref", "$defs", "oneOf", "title"} & node.keys(), path
        for branch in node.get("allOf", []):
            junctor_free(branch, path)
        if "not" in node:
            junctor_free(node["not"], path)
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True, path
        if "default" in node and node.get("type") == "object":
            _stored, errors = admit_custom_resource({"x": node["default"]},
                                                   {"type": "object", "properties": {"x": node}})
            assert not errors, (path, errors)


def _prop(resource: crds.Resource, dotted: str) -> dict[str, Any]:
    node = schema(resource)
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def test_field_rules() -> None:
    t, s = crds.TRAINING, crds.SERVING
    assert schema(t)["properties"]["spec"]["required"] == ["image"]
    assert _prop(t, "spec.workers.replicas").items() >= {"type": "integer", "minimum": 1}.items()
    assert _prop(t, "spec.runPolicy.backoffLimit").items() >= {"type": "integer", "minimum": 0}.items()
    assert _prop(t, "spec.runPolicy.cleanPodPolicy")["enum"] == ["All", "Running", "None"]
    assert sorted(schema(s)["properties"]["spec"]["required"]) == ["checkpoint", "image"]
    assert _prop(s, "spec.replicas").items() >= {"type": "integer", "minimum": 1}.items()
    assert _prop(t, "spec.workers.accelerator")["enum"] == ["cpu", "nvidia", "ascend"]


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
def test_name_rules_fit_the_api_servers_metadata_restrictions(resource: crds.Resource) -> None:
    """Under metadata only name and generateName may be declared (both, typed, so the API server's CEL
    typing keeps name's maxLength and the rules' cost stays bounded); the rules are at the root."""
    root = schema(resource)
    meta = root["properties"]["metadata"]
    assert set(meta) == {"type", "properties"} and set(meta["properties"]) == {"name", "generateName"}
    assert meta["properties"]["name"] == {"type": "string", "maxLength": names.MAX_NAME_LENGTH}
    rules = [r["rule"] for r in root["x-kubernetes-validations"]]
    assert any(names.DNS_1035_PATTERN in r for r in rules) and any(str(names.MAX_NAME_LENGTH) in r for r in rules)


def test_replica_fields_have_the_hard_maximum() -> None:
    for resource, dotted in ((crds.TRAINING, "spec.workers.replicas"), (crds.SERVING, "spec.replicas"),
                             (crds.SERVING, "spec.router.replicas"), (crds.SERVING, "spec.autoscaling.maxReplicas"),
                             (crds.SERVING, "spec.autoscaling.minReplicas")):
        assert _prop(resource, dotted)["maximum"] == names.MAX_REPLICAS, dotted


def test_subresources_and_printer_columns() -> None:
    training = crds.crd(crds.TRAINING)["spec"]["versions"][0]
    serving = crds.crd(crds.SERVING)["spec"]["versions"][0]
    assert training["subresources"] == {"status": {}}
    assert serving["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert [c["name"] for c in training["additionalPrinterColumns"] if c.get("priority", 0) == 0] == \
        ["State", "Workers", "Progress", "Age"]
    assert [c["name"] for c in serving["additionalPrinterColumns"]] == ["URL", "Ready", "Replicas", "HitRate", "Age"]


def test_minimal_job_gets_every_default() -> None:
    """`image` and `workers` are all a newcomer writes; the API server fills in the rest."""
    stored, errors = admit_custom_resource(
        {"apiVersion": "grstack.io/v1alpha1", "kind": "GRTrainingJob", "metadata": {"name": "demo"},
         "spec": {"image": "grstack:cpu", "workers": {"replicas": 2}}}, schema(crds.TRAINING))
    assert errors == []
    spec = stored["spec"]
    assert spec["runPolicy"] == {"backoffLimit": 3, "cleanPodPolicy": "None", "suspend": False,
                                 "schedulingPolicy": {"gangScheduler": "None"}}
    assert spec["workers"]["accelerator"] == "cpu"
    assert spec["checkpoint"]["mountPath"] == "/var/grstack/run"
    assert "config" not in spec  # the operator supplies the built-in demo config
    assert GRTrainingJobSpec.model_validate(spec).workers.replicas == 2


INVALID = [
    (crds.TRAINING, {"workers": {"replicas": 1}}, "spec.image"),
    (crds.TRAINING, {"image": "x", "workers": {"replicas": 0}}, "spec.workers.replicas"),
    (crds.TRAINING, {"image": "x", "runPolicy": {"backoffLimit": -1}}, "spec.runPolicy.backoffLimit"),
    (crds.TRAINING, {"image": "x", "runPolicy": {"cleanPodPolicy": "Some"}}, "spec.runPolicy.cleanPodPolicy"),
    (crds.TRAINING, {"image": "x", "workers": {"accelerator": "tpu"}}, "spec.workers.accelerator"),
    (crds.TRAINING, {"image": ""}, "spec.image"),
    (crds.SERVING, {"image": "x"}, "spec.checkpoint"),
    (crds.SERVING, {"checkpoint": {"path": "/m"}}, "spec.image"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"}, "replicas": 0}, "spec.replicas"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"},
                    "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "maxReplicas must be >= minReplicas"),
    (crds.TRAINING, {"image": "x", "workers": {"replicas": 100000}}, "spec.workers.replicas"),
    (crds.TRAINING, {"image": "x", "workers": {"resources": {"requests": {"cpu": "lots"}}}}, "spec.workers.resources"),
    (crds.SERVING, {"image": "x", "checkpoint": "s3://b/m.pt", "storage": {"sizeLimit": "1 Gi"}}, "spec.storage"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"}, "disruptionBudget": {"maxUnavailable": "1"}},
     "spec.disruptionBudget.maxUnavailable"),
]


@pytest.mark.parametrize(("resource", "spec", "named"), INVALID, ids=[i[2] for i in INVALID])
def test_invalid_specs_are_rejected_naming_the_field(resource: crds.Resource, spec: dict[str, Any],
                                                     named: str) -> None:
    obj = {"apiVersion": "grstack.io/v1alpha1", "kind": resource.kind, "metadata": {"name": "x"}, "spec": spec}
    _, errors = admit_custom_resource(copy.deepcopy(obj), schema(resource))
    assert errors
    joined = "; ".join(errors)
    assert named.removeprefix("spec.").split(".")[-1] in joined, joined


def test_unknown_fields_are_pruned_like_the_api_server() -> None:
    stored, errors = admit_custom_resource(
        {"metadata": {"name": "x"}, "spec": {"image": "x", "workerz": 3, "workers": {"replicas": 1, "gpus": 2}}},
        schema(crds.TRAINING))
    assert errors == []
    assert "workerz" not in stored["spec"] and "gpus" not in stored["spec"]["workers"]


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*job*.yaml")), ids=lambda p: p.name)
def test_example_jobs_are_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        _, errors = admit_custom_resource(doc, schema(crds.TRAINING))
        assert errors == []
        GRTrainingJobSpec.model_validate(doc["spec"])


MINIMAL = [
    (crds.TRAINING, GRTrainingJobSpec, {"image": "x"}),
    (crds.SERVING, GRRankingServiceSpec, {"image": "x", "checkpoint": {"path": "/m/model.pt"}}),
]


@pytest.mark.parametrize(("resource", "model", "spec"), MINIMAL, ids=lambda v: getattr(v, "kind", ""))
def test_schema_defaults_agree_with_the_model(resource: crds.Resource, model: Any, spec: dict[str, Any]) -> None:
    """What the API server stores (schema defaults) and what pydantic fills in are the same spec."""
    stored, errors = admit_custom_resource({"metadata": {"name": "x"}, "spec": spec}, schema(resource))
    assert errors == []
    assert model.model_validate(stored["spec"]) == model.model_validate(spec)
    assert stored["spec"] != spec  # defaults were applied


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
def test_every_spec_field_is_documented(resource: crds.Resource) -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    spec = schema(resource)["properties"]["spec"]
    missing = [path for path, _ in _walk(spec) if path and path.rsplit(".", 1)[-1].strip("[]{}")
               and path.rsplit(".", 1)[-1].strip("[]{}") not in docs]
    assert missing == [], f"document these {resource.kind} fields in docs/kubernetes.md"

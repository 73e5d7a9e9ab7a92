"""Resource names as the API server will take them: the CRDs' CEL rules refuse what is not a DNS-1035 label or
too long for the longest derived child name (the API server itself only checks a DNS subdomain, so "demo.v2"
and "1demo" would pass and their Services and pod hostnames be refused later), and the operator refuses the
same names when an API server skipped the rules."""

from __future__ import annotations

import datetime as dt
import json
import re
from typing import Any

import pytest
from opsim import REPO, admit_custom_resource

from grstack.operator import crds, names
from grstack.operator.serving import reconcile_serving
from grstack.operator.training import reconcile_training

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
BAD = {"demo.v2": "DNS-1035", "1demo": "DNS-1035", "Demo": "DNS-1035", "demo-": "DNS-1035", "de_mo": "DNS-1035",
       "a" * (names.MAX_NAME_LENGTH + 1): f"at most {names.MAX_NAME_LENGTH}"}
GOOD = ["demo", "a", "rank-2", "a" * names.MAX_NAME_LENGTH]
SPECS = {crds.TRAINING.kind: {"image": "grstack:cpu"},
         crds.SERVING.kind: {"image": "grstack:cpu", "checkpoint": {"path": "/m/best.pt"}}}


def manifest(resource: crds.Resource, name: str) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": resource.kind,
            "metadata": {"name": name, "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": json.loads(json.dumps(SPECS[resource.kind]))}


def admit(resource: crds.Resource, name: str) -> list[str]:
    schema = crds.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return admit_custom_resource(manifest(resource, name), schema)[1]


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
@pytest.mark.parametrize("name", BAD, ids=lambda n: n[:12])
def test_the_crd_refuses_a_name_the_children_cannot_carry(resource: crds.Resource, name: str) -> None:
    errors = admit(resource, name)
    assert errors and any(BAD[name] in e for e in errors), errors


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
@pytest.mark.parametrize("name", GOOD, ids=lambda n: n[:12])
def test_the_crd_admits_dns_1035_labels(resource: crds.Resource, name: str) -> None:
    assert admit(resource, name) == []


@pytest.mark.parametrize("name", BAD, ids=lambda n: n[:12])
def test_the_operator_refuses_the_same_names(name: str) -> None:
    plan = reconcile_training(manifest(crds.TRAINING, name), [], NOW)
    assert plan.status["state"] == "Failed" and not plan.create_pods and not plan.children
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec" and "metadata.name" in failed["message"], failed
    assert BAD[name] in failed["message"]
    plan = reconcile_serving(manifest(crds.SERVING, name), {}, [], NOW)
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "metadata.name" in ready["message"] and not plan.children, ready


def test_the_longest_name_leaves_room_for_every_child() -> None:
    """Each name the operator (or a controller acting for it) derives is a DNS label or label value: at most 63."""
    name = "a" * names.MAX_NAME_LENGTH
    derived = [names.worker_pod_name(name, names.MAX_REPLICAS - 1), names.workers_service_name(name),
               names.job_config_name(name), names.job_account_name(name), names.router_name(name),
               names.etcd_name(name), names.ranker_name(name) + "-" + "h" * names.REVISION_HASH_LENGTH,
               f"{names.ranker_name(name)}-{names.MAX_REPLICAS - 1}"]
    assert max(map(len, derived)) == names.DNS_LABEL_MAX
    dns_1035 = re.compile(names.DNS_1035_PATTERN)
    plan = reconcile_training(manifest(crds.TRAINING, name), [], NOW)
    assert plan.create_pods and all(len(c["metadata"]["name"]) <= 63 for c in plan.children + plan.create_pods)
    assert all(dns_1035.match(c["metadata"]["name"]) for c in plan.children if c["kind"] == "Service")
    plan = reconcile_serving(manifest(crds.SERVING, name), {}, [], NOW)
    assert plan.children and all(len(c["metadata"]["name"]) <= 63 for c in plan.children)


def test_the_chart_names_its_ranking_service_by_the_same_rule() -> None:
    schema = json.loads((REPO / "charts" / "grstack" / "values.schema.json").read_text())
    name = schema["properties"]["rankingService"]["properties"]["name"]
    assert name["maxLength"] == names.MAX_NAME_LENGTH
    assert name["pattern"] == "^(" + names.DNS_1035_PATTERN.strip("^$") + ")?$"

"""The GRRankingService CRD schema on valid and invalid manifests, as the API server (and the emulator) admit
them: the checkpoint's two forms (object, storage URI string), replicas, the new optional sections."""

from __future__ import annotations

from typing import Any

import pytest
from opsim import admit_custom_resource

from grstack.operator import crds, names
from grstack.operator.models import GRRankingServiceSpec

pytestmark = pytest.mark.unit

SCHEMA = crds.crd(crds.SERVING)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def manifest(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "default"}, "spec": spec}


VALID = {
    "object checkpoint": {"image": "i", "checkpoint": {"path": "/models/m.pt", "claimName": "models"}},
    "pvc uri": {"image": "i", "checkpoint": "pvc://models/exports/m.pt"},
    "s3 uri": {"image": "i", "checkpoint": "s3://bucket/m.pt", "storage": {"secretName": "creds"}},
    "gs uri": {"image": "i", "checkpoint": "gs://bucket/run/"},
    "https uri": {"image": "i", "checkpoint": "https://example.com/m.pt"},
    "replicas 3": {"image": "i", "checkpoint": {"path": "/m"}, "replicas": 3},
    "autoscaling with cpu request": {"image": "i", "checkpoint": {"path": "/m"}, "autoscaling": {"maxReplicas": 4},
                                     "ranker": {"resources": {"requests": {"cpu": "1"}}}},
    "pdb settings": {"image": "i", "checkpoint": {"path": "/m"}, "disruptionBudget": {"maxUnavailable": "50%"},
                     "hitRateWindowSeconds": 60},
    "load balancer with auth": {"image": "i", "checkpoint": {"path": "/m"}, "router": {"serviceType": "LoadBalancer"},
                                "auth": {"tokenSecret": "t", "openPaths": ["healthz", "readyz", "metrics"]}},
    "tls with client auth": {"image": "i", "checkpoint": {"path": "/m"},
                             "tls": {"secretName": "t", "clientAuth": True}},
}
INVALID = {
    "no image": {"checkpoint": {"path": "/m"}},
    "no checkpoint": {"image": "i"},
    "object without path": {"image": "i", "checkpoint": {"claimName": "models"}},
    "relative string": {"image": "i", "checkpoint": "models/m.pt"},
    "ftp uri": {"image": "i", "checkpoint": "ftp://host/m.pt"},
    "number checkpoint": {"image": "i", "checkpoint": 7},
    "list checkpoint": {"image": "i", "checkpoint": ["s3://b/m.pt"]},
    "boolean checkpoint": {"image": "i", "checkpoint": True},
    "replicas 0": {"image": "i", "checkpoint": {"path": "/m"}, "replicas": 0},
    "replicas string": {"image": "i", "checkpoint": {"path": "/m"}, "replicas": "2"},
    "replicas float": {"image": "i", "checkpoint": {"path": "/m"}, "replicas": 1.5},
    "window too short": {"image": "i", "checkpoint": {"path": "/m"}, "hitRateWindowSeconds": 1},
    "load balancer without auth": {"image": "i", "checkpoint": {"path": "/m"},
                                   "router": {"serviceType": "LoadBalancer"}},
    "node port without auth": {"image": "i", "checkpoint": {"path": "/m"}, "router": {"serviceType": "NodePort"}},
    "auth without a secret": {"image": "i", "checkpoint": {"path": "/m"}, "auth": {"tokenKey": "k"}},
    "tls without a secret": {"image": "i", "checkpoint": {"path": "/m"}, "tls": {"clientAuth": True}},
    "open path with a space": {"image": "i", "checkpoint": {"path": "/m"},
                               "auth": {"tokenSecret": "t", "openPaths": ["healthz", "readyz", "a b"]}},
}


@pytest.mark.parametrize("case", VALID)
def test_valid_manifests_are_admitted(case: str) -> None:
    stored, errors = admit_custom_resource(manifest(**VALID[case]), SCHEMA)
    assert errors == []
    GRRankingServiceSpec.model_validate(stored["spec"])  # and the operator agrees
    assert stored["spec"]["storage"]["mountPath"] == "/mnt/models"  # new sections default
    assert stored["spec"]["disruptionBudget"]["enabled"] is True


@pytest.mark.parametrize("case", INVALID)
def test_invalid_manifests_are_rejected(case: str) -> None:
    _, errors = admit_custom_resource(manifest(**INVALID[case]), SCHEMA)
    assert errors, case


def test_autoscaling_cpu_rule_is_in_the_crd() -> None:
    rules = SCHEMA["properties"]["spec"]["x-kubernetes-validations"]
    assert any("requests.cpu" in r["message"] for r in rules)


@pytest.mark.parametrize("example", ["ranking-service.yaml", "ranking-service-s3.yaml"])
def test_examples_are_admitted_and_valid(example: str) -> None:
    import yaml
    from opsim import REPO

    doc = yaml.safe_load((REPO / "examples" / example).read_text())
    stored, errors = admit_custom_resource(doc, SCHEMA)
    assert errors == []
    GRRankingServiceSpec.model_validate(stored["spec"])

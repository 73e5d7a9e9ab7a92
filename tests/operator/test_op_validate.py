"""Every object the operator generates validates against the official Kubernetes schemas (strict: unknown
fields are errors), for the oldest supported and the newest Kubernetes that kubernetes-validate ships."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from grstack.operator import names
from grstack.operator.serving import reconcile_serving
from grstack.operator.training import reconcile_training

pytestmark = pytest.mark.unit

KUBE_VERSIONS = ("1.27", latest_version())
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
META = {"namespace": "team-a", "uid": "7f1d4c0e-0000-4000-8000-000000000001", "generation": 1}

TRAINING_SPECS = {
    "minimal": {"image": "grstack:cpu"},
    "nvidia-pvc-scheduling": {
        "image": "registry.example.com/grstack:cuda", "imagePullPolicy": "Always", "imagePullSecrets": ["regcred"],
        "workers": {"replicas": 4, "accelerator": "nvidia",
                    "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        "checkpoint": {"claimName": "ckpt", "intervalSteps": 500}, "data": {"claimName": "datasets"},
        "scheduling": {"schedulerName": "volcano", "priorityClassName": "high", "nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                           "nodeSelectorTerms": [{"matchExpressions": [
                               {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
    },
    "ascend": {"image": "grstack:ascend", "workers": {"replicas": 2, "accelerator": "ascend"}},
}

SERVING_SPECS = {
    "minimal": {"image": "grstack:cpu", "checkpoint": {"path": "/models/best.pt"}},
    "managed-etcd-autoscaling-gpu": {
        "image": "grstack:cuda", "checkpoint": {"path": "run/best.pt", "claimName": "models"}, "replicas": 3,
        "autoscaling": {"minReplicas": 2, "maxReplicas": 8}, "etcd": {"managed": True},
        "ranker": {"accelerator": "nvidia", "resources": {"requests": {"cpu": "4"}, "limits": {"memory": "32Gi"}}},
        "router": {"replicas": 2, "serviceType": "LoadBalancer"},
        "scheduling": {"nodeSelector": {"pool": "serving"}},
        "auth": {"tokenSecret": "clients", "rankerTokenSecret": "internal"},  # LoadBalancer needs auth
        "tls": {"secretName": "rank-tls", "clientAuth": True},
    },
    "storage-uri": {"image": "grstack:cpu", "checkpoint": "s3://models/run/model.pt",
                    "storage": {"secretName": "s3-creds", "sizeLimit": "20Gi"}, "disruptionBudget": {"maxUnavailable": "50%"}},
    "pvc-uri": {"image": "grstack:cpu", "checkpoint": "pvc://models/run/model.pt"},
    "external-etcd": {"image": "grstack:cpu", "checkpoint": {"path": "/m"},
                      "etcd": {"endpoints": ["http://etcd-0.etcd:2379", "http://etcd-1.etcd:2379"]}},
}


def _training_objects(spec: dict[str, Any]) -> list[dict[str, Any]]:
    job = {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "metadata": {"name": "demo", **META},
           "spec": spec}
    plan = reconcile_training(job, [], NOW)
    assert plan.status["state"] == "Created", plan.status
    return plan.children + plan.create_pods


def _serving_objects(spec: dict[str, Any]) -> list[dict[str, Any]]:
    svc = {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "metadata": {"name": "rank", **META},
           "spec": spec}
    return reconcile_serving(svc, {}, [], NOW).children


CASES = [(f"training-{k}", _training_objects, v) for k, v in TRAINING_SPECS.items()] + \
        [(f"serving-{k}", _serving_objects, v) for k, v in SERVING_SPECS.items()]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize(("name", "build", "spec"), CASES, ids=[c[0] for c in CASES])
def test_generated_objects_validate(name: str, build: Any, spec: dict[str, Any], version: str) -> None:
    objects = build(spec)
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_validation_catches_mistakes() -> None:
    """Negative control: the validator used above does reject a malformed pod."""
    pod = copy.deepcopy(next(o for o in _training_objects(TRAINING_SPECS["minimal"]) if o["kind"] == "Pod"))
    pod["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, latest_version(), strict=True)
    pod = copy.deepcopy(next(o for o in _training_objects(TRAINING_SPECS["minimal"]) if o["kind"] == "Pod"))
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = "29500"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, latest_version(), strict=True)

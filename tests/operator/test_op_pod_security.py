"""Pod security of GRTrainingJob pod templates and replica bounds: what a job author cannot ask for unless the
cluster admin allows it (the operator creates the pods with its own permissions), the restricted
securityContext every container gets, and the CRDs' and the operator's replica limits."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from opsim import REPO, admit_custom_resource

from grstack.operator import crds, names, policy
from grstack.operator.serving import reconcile_serving
from grstack.operator.training import reconcile_training
from grstack.runtime.cli import main

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def allowed() -> Iterator[None]:
    policy.configure(policy.ClusterPolicy(allow_privileged=True))
    yield
    policy.configure(policy.ClusterPolicy())


def job(template_spec: dict[str, Any] | None = None, **workers: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {"image": "grstack:cpu", "workers": {"template": {"spec": template_spec or {}}, **workers}},
            "status": {}}


def refusal(plan: Any) -> str:
    assert plan.status["state"] == "Failed" and not plan.create_pods, plan.status
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec", failed
    return str(failed["message"])


SIDECAR = {"name": "shipper", "image": "fluent-bit:3"}
FORBIDDEN = {
    "hostNetwork": ({"hostNetwork": True}, "spec.hostNetwork"),
    "hostPID": ({"hostPID": True}, "spec.hostPID"),
    "hostIPC": ({"hostIPC": True}, "spec.hostIPC"),
    "hostPath": ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}, "spec.volumes[root].hostPath"),
    "privileged": ({"containers": [{**SIDECAR, "securityContext": {"privileged": True}}]},
                   "spec.containers[shipper].securityContext.privileged"),
    "allowPrivilegeEscalation": (
        {"initContainers": [{**SIDECAR, "securityContext": {"allowPrivilegeEscalation": True}}]},
        "spec.initContainers[shipper].securityContext.allowPrivilegeEscalation"),
    "capabilities.add": ({"containers": [{"name": "trainer", "securityContext": {"capabilities": {
        "add": ["SYS_ADMIN"]}}}]}, "spec.containers[trainer].securityContext.capabilities.add: SYS_ADMIN"),
    "runAsUser 0 (pod)": ({"securityContext": {"runAsUser": 0}}, "spec.securityContext.runAsUser"),
    "runAsUser 0 (container)": ({"containers": [{**SIDECAR, "securityContext": {"runAsUser": 0}}]},
                                "spec.containers[shipper].securityContext.runAsUser"),
    "runAsNonRoot false": ({"securityContext": {"runAsNonRoot": False}}, "spec.securityContext.runAsNonRoot"),
    "seccomp Unconfined": ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
                           "spec.securityContext.seccompProfile"),
    "serviceAccountName": ({"serviceAccountName": "cluster-admin-sa"}, "spec.serviceAccountName"),
    "serviceAccount": ({"serviceAccount": "cluster-admin-sa"}, "spec.serviceAccount"),
    "automountServiceAccountToken": ({"automountServiceAccountToken": True}, "spec.automountServiceAccountToken"),
    "hostPort": ({"containers": [{**SIDECAR, "ports": [{"containerPort": 80, "hostPort": 80}]}]},
                 "spec.containers[shipper].ports[80].hostPort"),
}


@pytest.mark.parametrize("case", FORBIDDEN)
def test_each_forbidden_template_field_is_refused_naming_it(case: str) -> None:
    template, field = FORBIDDEN[case]
    message = refusal(reconcile_training(job(template), [], NOW))
    assert field in message and "operator.podSecurity.allowPrivileged" in message, message


def test_every_violation_is_named_at_once() -> None:
    message = refusal(reconcile_training(job({"hostNetwork": True, "hostPID": True,
                                              "serviceAccountName": "x"}), [], NOW))
    assert all(f in message for f in ("spec.hostNetwork", "spec.hostPID", "spec.serviceAccountName")), message


def test_false_and_harmless_values_pass() -> None:
    plan = reconcile_training(job({"hostNetwork": False, "securityContext": {"runAsUser": 2000},
                                   "containers": [{**SIDECAR, "securityContext": {
                                       "allowPrivilegeEscalation": False, "capabilities": {"drop": ["NET_RAW"]}}}]}),
                              [], NOW)
    assert plan.create_pods, plan.status


@pytest.mark.parametrize("case", FORBIDDEN)
def test_the_chart_switch_allows_them(case: str, allowed: None) -> None:
    plan = reconcile_training(job(FORBIDDEN[case][0]), [], NOW)
    assert plan.create_pods, plan.status


def test_every_container_gets_the_restricted_defaults() -> None:
    plan = reconcile_training(job({
        "initContainers": [{"name": "fetch", "image": "busybox"}],
        "containers": [SIDECAR, {"name": "strict", "image": "x", "securityContext": {
            "runAsUser": 4242, "capabilities": {"drop": ["NET_RAW"]},
            "seccompProfile": {"type": "Localhost", "localhostProfile": "strict.json"}}}]}), [], NOW)
    spec = plan.create_pods[0]["spec"]
    containers = {c["name"]: c for c in spec["initContainers"] + spec["containers"]}
    assert set(containers) == {"fetch", "trainer", "shipper", "strict"}
    for name, c in containers.items():
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True, (name, sc)
        assert "ALL" in sc["capabilities"]["drop"] and "add" not in sc["capabilities"], (name, sc)
        assert sc["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost"), (name, sc)
    strict = containers["strict"]["securityContext"]  # stricter settings stay
    assert strict["runAsUser"] == 4242 and strict["seccompProfile"]["type"] == "Localhost"
    assert strict["capabilities"]["drop"] == ["NET_RAW", "ALL"]
    assert containers["shipper"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["serviceAccountName"] == "demo-worker" and spec["securityContext"]["runAsNonRoot"] is True


def test_allowed_privileges_are_coherent(allowed: None) -> None:
    """What the API server or the kubelet would refuse is not added to an allowed privileged or root pod."""
    plan = reconcile_training(job({"securityContext": {"runAsUser": 0},
                                   "containers": [{**SIDECAR, "securityContext": {"privileged": True}}]}), [], NOW)
    spec = plan.create_pods[0]["spec"]
    assert "runAsNonRoot" not in spec["securityContext"]
    shipper = next(c for c in spec["containers"] if c["name"] == "shipper")["securityContext"]
    assert shipper["privileged"] is True and "allowPrivilegeEscalation" not in shipper and "runAsNonRoot" not in shipper


def test_the_multinode_example_sidecar_gets_the_restricted_profile() -> None:
    doc = yaml.safe_load((REPO / "examples" / "training-job-multinode.yaml").read_text())
    doc["spec"].setdefault("runPolicy", {})["suspend"] = False  # created suspended, for Kueue or a human
    plan = reconcile_training({**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "u", "generation": 1},
                               "status": {}}, [], NOW)
    assert plan.create_pods, plan.status
    for c in plan.create_pods[0]["spec"]["containers"] + plan.create_pods[0]["spec"].get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True and \
            sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"] == {"type": "RuntimeDefault"}, c["name"]


def test_ranking_service_containers_are_restricted() -> None:
    svc = {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
           "metadata": {"name": "rank", "namespace": "ns", "uid": "u", "generation": 1},
           "spec": {"image": "grstack:cpu", "checkpoint": "s3://m/model.pt", "etcd": {"managed": True}}}
    plan = reconcile_serving(svc, {}, [], NOW)
    pods = [c["spec"]["template"]["spec"] for c in plan.children if c["kind"] in ("StatefulSet", "Deployment")]
    assert len(pods) == 3
    for pod in pods:
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"] is True and \
                sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}, c


# ---------------------------------------------------------------------------------------------- replicas


def _schema(resource: crds.Resource) -> dict[str, Any]:
    return crds.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize(("resource", "spec", "field"), [
    (crds.TRAINING, {"image": "x", "workers": {"replicas": 100000}}, "spec.workers.replicas"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"}, "replicas": 100000}, "spec.replicas"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"}, "router": {"replicas": 100000}},
     "spec.router.replicas"),
    (crds.SERVING, {"image": "x", "checkpoint": {"path": "/m"}, "ranker": {"resources": {"requests": {"cpu": 1}}},
                    "autoscaling": {"maxReplicas": 100000}}, "spec.autoscaling.maxReplicas"),
])
def test_the_crds_refuse_100000_replicas(resource: crds.Resource, spec: dict[str, Any], field: str) -> None:
    obj = {"apiVersion": names.API_VERSION, "kind": resource.kind, "metadata": {"name": "big"}, "spec": spec}
    errors = admit_custom_resource(obj, _schema(resource))[1]
    assert any(e.startswith(field) and str(names.MAX_REPLICAS) in e for e in errors), errors
    obj["spec"] = json.loads(json.dumps(spec).replace("100000", str(names.MAX_REPLICAS)))
    assert admit_custom_resource(obj, _schema(resource))[1] == []


def test_the_operator_enforces_the_configured_bound() -> None:
    assert refusal(reconcile_training(job(replicas=100000), [], NOW)).startswith("spec.workers.replicas")
    policy.configure(policy.ClusterPolicy(max_replicas=8))
    try:
        message = refusal(reconcile_training(job(replicas=9), [], NOW))
        assert "workers.replicas: 9 is above this cluster's limit of 8" in message, message
        assert reconcile_training(job(replicas=8), [], NOW).create_pods
        svc = {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
               "metadata": {"name": "rank", "namespace": "ns", "uid": "u", "generation": 1},
               "spec": {"image": "x", "checkpoint": {"path": "/m"}, "replicas": 9}}
        ready = next(c for c in reconcile_serving(svc, {}, [], NOW).status["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "InvalidSpec" and "replicas: 9 is above" in ready["message"], ready
    finally:
        policy.configure(policy.ClusterPolicy())


@pytest.mark.parametrize(("argv", "message"), [
    (["operator", "--max-replicas", "0"], "--max-replicas 0: must be 1-1000"),
    (["operator", "--max-replicas", "5000"], "--max-replicas 5000: must be 1-1000"),
])
def test_operator_flags_refuse_bad_bounds(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_chart_passes_the_switches_to_the_operator() -> None:
    import helm_python as helm

    def args(values: dict[str, Any]) -> list[str]:
        with helm.Chart.load(REPO / "charts" / "grstack") as chart:
            files = chart.render(values, name="grstack", namespace="grstack-system", is_install=True)
        docs = [d for name, text in files.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
        deploy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "grstack-operator")
        return list(deploy["spec"]["template"]["spec"]["containers"][0]["args"])

    default = args({})
    assert "--max-replicas=1000" in default and "--allow-privileged-pods" not in default
    custom = args({"operator": {"podSecurity": {"allowPrivileged": True}, "limits": {"maxReplicas": 16}}})
    assert "--max-replicas=16" in custom and "--allow-privileged-pods" in custom

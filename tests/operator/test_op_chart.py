"""The Helm chart, rendered and linted with Helm's Go SDK (helm-python-sdk), every manifest validated against
the official Kubernetes schemas; the GRRankingService a serving release creates against the CRD."""

from __future__ import annotations

import datetime as dt
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from opsim import REPO, admit_custom_resource

from grstack.operator import crds, names
from grstack.operator.models import GRRankingServiceSpec
from grstack.operator.serving import reconcile_serving
from grstack.operator.training import reconcile_training

pytestmark = pytest.mark.unit

CHART = REPO / "charts" / "grstack"
SERVING_VALUES = yaml.safe_load((REPO / "examples" / "serving-values.yaml").read_text())
SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced-operator": {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "etcd": {"enabled": True}},
    "etcd-persistent": {"etcd": {"enabled": True, "persistence": {"enabled": True, "storageClassName": "fast"}},
                        "imagePullSecrets": ["regcred"], "operator": {"metrics": {"enabled": False}}},
    "serving-release": SERVING_VALUES,
    "extras": {"networkPolicy": {"enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {
        "name": "monitoring"}}}]}, "operator": {"metrics": {"serviceMonitor": {"enabled": True}}}},
    "serving-uri-netpol": {"operator": {"enabled": False}, "networkPolicy": {"enabled": True},
                           "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://models/hstu/model.pt",
                                                                        "storage": {"secretName": "s3"}}}},
    "single-operator": {"operator": {"leaderElection": {"enabled": False}}},
    "privileged-pods-small-limit": {"operator": {"podSecurity": {"allowPrivileged": True},
                                                 "limits": {"maxReplicas": 64}}},
    "serving-locked-down": {
        "operator": {"enabled": False}, "etcd": {"enabled": True, "serverTLS": {"secretName": "etcd-tls"}},
        "rankingService": {"enabled": True, "spec": {
            "checkpoint": "s3://models/hstu/model.pt", "router": {"serviceType": "LoadBalancer"},
            "auth": {"tokenSecret": "clients", "rankerTokenSecret": "internal"},
            "tls": {"secretName": "ranker-tls", "clientAuth": True}}}},
    "managed-etcd-no-netpol": {"networkPolicy": {"enabled": False}, "rankingService": {"enabled": True, "spec": {
        "checkpoint": {"path": "/m"}, "etcd": {"managed": True}}}},
}
# Kinds of other APIs' CRDs (kopf's peering, prometheus-operator): checked here by shape, not by the
# Kubernetes schemas.
FOREIGN = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor"}


def render(values: dict[str, Any], release: str = "grstack") -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=release, namespace="grstack-system", is_install=True)
    docs = []
    for name, text in files.items():
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def test_chart_crds_are_the_generated_ones() -> None:
    with helm.Chart.load(CHART) as chart:
        shipped = {c["name"].removeprefix("crds/"): c["data"] for c in chart.crds}
    assert shipped == crds.rendered_files()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_lint(scenario: str) -> None:
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("version", ["1.27", latest_version()])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_manifests_validate(scenario: str, version: str) -> None:
    docs = render(SCENARIOS[scenario])
    assert docs
    for doc in docs:
        if doc["kind"] == names.SERVING_KIND:
            schema = crds.crd(crds.SERVING)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            stored, errors = admit_custom_resource(doc, schema)
            assert errors == [], errors
            GRRankingServiceSpec.model_validate(stored["spec"])
            continue
        if doc["kind"] in FOREIGN:
            assert doc["apiVersion"] in ("kopf.dev/v1", "monitoring.coreos.com/v1") and doc["metadata"]["name"]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")


def kinds(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def test_operator_deployment() -> None:
    docs = kinds(render({}))
    assert sorted(docs) == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment",
                            "NetworkPolicy", "Service", "ServiceAccount"]
    deploy = docs["Deployment"][0]["spec"]
    # Two replicas, one leader: kopf peering through the ClusterKopfPeering the chart creates.
    assert deploy["replicas"] == 2 and deploy["strategy"]["type"] == "RollingUpdate"
    assert deploy["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert docs["ClusterKopfPeering"][0]["metadata"]["name"] == "grstack"
    container = deploy["template"]["spec"]["containers"][0]
    assert container["command"] == ["grstack"] and container["args"][:2] == ["operator", "--all-namespaces"]
    assert "--peering=grstack" in container["args"] and "--readiness-port=8081" in container["args"]
    assert {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container["env"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ready"}
    anti = deploy["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"
    crd_rules = next(r for r in docs["ClusterRole"] if r["metadata"]["name"] == "grstack-crds")["rules"]
    assert _allowed(crd_rules, "kopf.dev", "clusterkopfpeerings", "patch")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deploy["template"]["spec"]["serviceAccountName"] == "grstack"


def _allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_rbac_is_least_privilege_and_sufficient() -> None:
    docs = kinds(render({}))
    rules = next(r for r in docs["ClusterRole"] if r["metadata"]["name"] == "grstack")["rules"]
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert "secrets" not in rule["resources"]
    # Everything the reconcilers create, the operator may create, read and patch.
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    meta = {"namespace": "ns", "uid": "u", "generation": 1}
    job = {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND, "metadata": {"name": "j", **meta},
           "spec": {"image": "i"}}
    svc = {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND, "metadata": {"name": "s", **meta},
           "spec": {"image": "i", "checkpoint": {"path": "/m"}, "etcd": {"managed": True},
                    "autoscaling": {"maxReplicas": 3}}}
    plan = reconcile_training(job, [], now)
    created = plan.children + plan.create_pods + reconcile_serving(svc, {}, [], now).children
    for scheduler in ("Coscheduling", "Volcano"):  # gang-scheduled jobs also create their PodGroup
        gang = {**job, "spec": {"image": "i", "runPolicy": {"schedulingPolicy": {"gangScheduler": scheduler}}}}
        created += [c for c in reconcile_training(gang, [], now).children if c["kind"] == "PodGroup"]
    assert sum(c["kind"] == "PodGroup" for c in created) == 2
    plurals = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "ServiceAccount": "serviceaccounts",
               "Role": "roles", "RoleBinding": "rolebindings", "StatefulSet": "statefulsets",
               "Deployment": "deployments", "HorizontalPodAutoscaler": "horizontalpodautoscalers",
               "PodDisruptionBudget": "poddisruptionbudgets", "PodGroup": "podgroups"}
    for obj in created:
        group = obj["apiVersion"].rpartition("/")[0]
        for verb in ("get", "create", "patch", "delete"):
            assert _allowed(rules, group, plurals[obj["kind"]], verb), (obj["kind"], verb)
    # RBAC escalation check: the operator holds what it grants to workers.
    for role in (o for o in created if o["kind"] == "Role"):
        for rule in role["rules"]:
            for verb in rule["verbs"]:
                assert _allowed(rules, "", "pods", verb)
    for plural in ("grtrainingjobs", "grrankingservices"):
        assert _allowed(rules, "grstack.io", f"{plural}/status", "patch")
        assert _allowed(rules, "grstack.io", plural, "watch")


def test_namespaced_operator_uses_roles() -> None:
    docs = kinds(render(SCENARIOS["namespaced-operator"]))
    assert [r["metadata"]["namespace"] for r in docs["Role"]] == ["team-a", "team-b"]
    assert [r["metadata"]["name"] for r in docs["ClusterRole"]] == ["grstack-crds"]
    args = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args
    assert [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in docs["KopfPeering"]] == [
        ("team-a", "grstack"), ("team-b", "grstack")]
    assert "ClusterKopfPeering" not in docs
    rules = docs["Role"][0]["rules"]
    assert _allowed(rules, "kopf.dev", "kopfpeerings", "patch") and _allowed(rules, "kopf.dev", "kopfpeerings", "watch")


def test_serving_release_creates_a_ranking_service() -> None:
    docs = kinds(render(SERVING_VALUES, release="ranker"))
    assert sorted(docs) == ["GRRankingService", "NetworkPolicy", "Service", "StatefulSet"]  # + etcd; no operator
    svc = docs["GRRankingService"][0]
    assert svc["metadata"]["name"] == "ranker"
    assert svc["spec"]["image"] == "ghcr.io/grstack/grstack:0.1.0-cpu"
    assert svc["spec"]["etcd"] == {"endpoints": ["http://ranker-grstack-etcd-client:2379"]}
    assert svc["spec"]["replicas"] == 2
    etcd_client = next(s for s in docs["Service"] if s["metadata"]["name"] == "ranker-grstack-etcd-client")
    assert etcd_client["spec"]["ports"][0]["port"] == 2379


def test_serving_release_requires_a_checkpoint() -> None:
    with pytest.raises(helm.HelmError, match=r"checkpoint\.path is required"):
        render({"operator": {"enabled": False}, "rankingService": {"enabled": True}})
    docs = kinds(render(SCENARIOS["serving-uri-netpol"], release="ranker"))
    assert docs["GRRankingService"][0]["spec"]["checkpoint"] == "s3://models/hstu/model.pt"


BAD_VALUES = {
    "namespace glob": ({"operator": {"watchNamespaces": ["team-*"]}}, "watchNamespaces/0"),
    "namespace with a capital": ({"operator": {"watchNamespaces": ["Team"]}}, "watchNamespaces/0"),
    "zero replicas": ({"operator": {"replicas": 0}}, "replicas"),
    "unknown operator key": ({"operator": {"replica": 2}}, "replica"),
    "port out of range": ({"operator": {"metrics": {"port": 70000}}}, "port"),
    "pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    "typo at the top": ({"netwrokPolicy": {"enabled": True}}, "netwrokPolicy"),
    "ranking replicas": ({"rankingService": {"enabled": True, "spec": {"replicas": 0, "checkpoint": "s3://b/m"}}},
                         "replicas"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_values_schema_refuses_bad_values(case: str) -> None:
    """values.schema.json: a bad value fails `helm install` (and lint) before anything reaches the cluster."""
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmError, match="schema") as exc:
        render(values)
    assert where in str(exc.value)
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["errors"], report


def test_single_operator_without_leader_election() -> None:
    docs = kinds(render(SCENARIOS["single-operator"]))
    deploy = docs["Deployment"][0]["spec"]
    assert deploy["replicas"] == 1 and deploy["strategy"] == {"type": "Recreate"}
    assert not any(a.startswith("--peering") for a in deploy["template"]["spec"]["containers"][0]["args"])
    assert "ClusterKopfPeering" not in docs


def test_network_policies_and_service_monitor() -> None:
    docs = kinds(render(SCENARIOS["extras"]))
    (policy,) = docs["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    metrics = next(rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"port": 9090}])
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    (monitor,) = docs["ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    metrics_service = next(s for s in docs["Service"] if s["metadata"]["name"].endswith("-operator-metrics"))
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    assert "ServiceMonitor" not in kinds(render({}))  # optional
    assert "NetworkPolicy" in kinds(render({}))  # on by default
    assert "NetworkPolicy" not in kinds(render({"networkPolicy": {"enabled": False}}))
    serving = kinds(render(SCENARIOS["serving-uri-netpol"], release="ranker"))
    ranker = next(p for p in serving["NetworkPolicy"] if p["metadata"]["name"] == "ranker-ranker")
    sources = ranker["spec"]["ingress"][0]["from"]
    assert sources[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert sources[1]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "grstack-system"}
    assert ranker["spec"]["ingress"][0]["ports"] == [{"port": 8000}]


def test_bundled_etcd_with_tls_and_client_certificates() -> None:
    docs = kinds(render(SCENARIOS["serving-locked-down"], release="ranker"))
    etcd = next(s for s in docs["StatefulSet"] if s["metadata"]["name"] == "ranker-grstack-etcd")["spec"]["template"]
    container = etcd["spec"]["containers"][0]
    args = container["args"]
    assert "--listen-client-urls=https://0.0.0.0:2379" in args and "--client-cert-auth" in args
    assert "--trusted-ca-file=/var/run/etcd-tls/ca.crt" in args
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}  # plain HTTP, no data
    tls = next(v for v in etcd["spec"]["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == "etcd-tls"
    spec = docs["GRRankingService"][0]["spec"]
    assert spec["etcd"] == {"endpoints": ["https://ranker-grstack-etcd-client:2379"],
                            "tls": {"caSecret": "etcd-tls", "clientCertSecret": "etcd-tls"}}
    assert spec["auth"]["tokenSecret"] == "clients" and spec["tls"] == {"secretName": "ranker-tls", "clientAuth": True}
    # The operator turns it into pods with the Secrets mounted (the rendered spec is a valid one).
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    svc = {**docs["GRRankingService"][0], "metadata": {**docs["GRRankingService"][0]["metadata"], "uid": "u"}}
    children = reconcile_serving(svc, {}, [], now).children
    router = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    assert "--auth-token-file" in args and "--ranker-cert" in args and "--etcd-cert" in args
    plain = kinds(render({"etcd": {"enabled": True}}))
    etcd_args = plain["StatefulSet"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--listen-client-urls=http://0.0.0.0:2379" in etcd_args and "--client-cert-auth" not in etcd_args


def test_etcd_network_policies() -> None:
    docs = kinds(render(SCENARIOS["serving-locked-down"], release="ranker"))
    policy = next(p for p in docs["NetworkPolicy"] if p["metadata"]["name"] == "ranker-grstack-etcd")["spec"]
    client = next(r for r in policy["ingress"] if r["ports"] == [{"port": 2379}])
    (peer,) = client["from"]
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["ranker", "router"]}]
    managed = kinds(render({"operator": {"enabled": False}, "rankingService": {"enabled": True, "spec": {
        "checkpoint": {"path": "/m"}, "etcd": {"managed": True}}}}, release="rank"))
    policy = next(p for p in managed["NetworkPolicy"] if p["metadata"]["name"] == "rank-managed-etcd")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"grstack.io/service-name": "rank",
                                                    "app.kubernetes.io/component": "etcd"}
    assert "NetworkPolicy" not in kinds(render(SCENARIOS["managed-etcd-no-netpol"]))


@pytest.mark.parametrize("values, message", [
    ({"rankingService": {"enabled": True, "spec": {"checkpoint": "s3://b/m", "router": {"serviceType": "LoadBalancer"}}}},
     "serviceType LoadBalancer exposes the routers"),
    ({"rankingService": {"enabled": True, "spec": {"checkpoint": "s3://b/m", "router": {"serviceType": "NodePort"}}}},
     "set rankingService.spec.auth"),
    ({"etcd": {"enabled": True, "auth": {"user": "u", "passwordSecret": "p"}},
      "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://b/m"}}}, "authenticates client certificates"),
    ({"etcd": {"enabled": True, "tls": {"clientCertSecret": "c"}},
      "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://b/m"}}}, "needs etcd.serverTLS.secretName"),
])
def test_chart_refuses_unsafe_serving(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)

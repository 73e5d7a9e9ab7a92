"""Issue #12 item 7: etcd TLS/auth and the placement TTL of a GRRankingService, from chart values through the
CRD to the flags and Secret mounts of the ranker and router pods."""

from __future__ import annotations

import datetime as dt
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from opsim import REPO, admit_custom_resource

from grstack.operator import crds, names
from grstack.operator.models import GRRankingServiceSpec
from grstack.operator.serving import reconcile_serving

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
CHART = REPO / "charts" / "grstack"
SCHEMA = crds.crd(crds.SERVING)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SECURE = {"endpoints": ["https://etcd.infra:2379"], "tls": {"caSecret": "etcd-ca", "clientCertSecret": "etcd-client"},
          "auth": {"user": "grs", "passwordSecret": "etcd-pw", "passwordKey": "pw"}, "placementTTLSeconds": 600}
CLIENT_FLAGS = ["--etcd-ca", "/var/run/secrets/grstack-etcd/ca/ca.crt",
                "--etcd-cert", "/var/run/secrets/grstack-etcd/client/tls.crt",
                "--etcd-key", "/var/run/secrets/grstack-etcd/client/tls.key",
                "--etcd-user", "grs", "--etcd-password-file", "/var/run/secrets/grstack-etcd/auth/password"]


def manifest(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "prod", "uid": "uid-9", "generation": 2},
            "spec": {"image": "grstack:cpu", "checkpoint": {"path": "/models/best.pt"}, **spec}}


def pods(plan: Any) -> dict[str, dict[str, Any]]:
    by = {(c["kind"], c["metadata"]["name"]): c for c in plan.children}
    return {"ranker": by[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"],
            "router": by[("Deployment", "rank-router")]["spec"]["template"]["spec"]}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="ranker", namespace="team-a", is_install=True)
    return [d for name, text in files.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_tls_auth_and_ttl_become_flags_and_secret_mounts() -> None:
    plan = reconcile_serving(manifest(etcd=SECURE), {}, [], NOW)
    assert plan.children, plan.status
    for role, pod in pods(plan).items():
        args = pod["containers"][0]["args"]
        i = args.index("--etcd-ca")
        assert args[i:i + len(CLIENT_FLAGS)] == CLIENT_FLAGS, role
        assert args[args.index("--etcd") + 1] == "https://etcd.infra:2379"
        secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {
            "etcd-ca": {"secretName": "etcd-ca", "defaultMode": 0o440, "items": [{"key": "ca.crt", "path": "ca.crt"}]},
            "etcd-client": {"secretName": "etcd-client", "defaultMode": 0o440,
                            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]},
            "etcd-auth": {"secretName": "etcd-pw", "defaultMode": 0o440, "items": [{"key": "pw", "path": "password"}]}}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        for vol, sub in (("etcd-ca", "ca"), ("etcd-client", "client"), ("etcd-auth", "auth")):
            assert mounts[vol] == {"name": vol, "mountPath": f"/var/run/secrets/grstack-etcd/{sub}", "readOnly": True}
    router = pods(plan)["router"]["containers"][0]["args"]
    assert router[router.index("--placement-ttl-s") + 1] == "600"
    assert "--placement-ttl-s" not in pods(plan)["ranker"]["containers"][0]["args"]  # the router's setting
    plain = pods(reconcile_serving(manifest(etcd={"endpoints": ["http://etcd:2379"]}), {}, [], NOW))
    for pod in plain.values():
        assert "--etcd-ca" not in pod["containers"][0]["args"] and "--placement-ttl-s" not in \
            pod["containers"][0]["args"]
        assert not [v for v in pod["volumes"] if v["name"].startswith("etcd-")]


@pytest.mark.parametrize("etcd, field", [
    ({"managed": True, "tls": {"caSecret": "ca"}}, "etcd.tls and etcd.auth need etcd.endpoints"),
    ({"auth": {"user": "grs", "passwordSecret": "pw"}}, "etcd.tls and etcd.auth need etcd.endpoints"),
    ({"endpoints": ["http://e:2379"], "auth": {"user": "grs"}}, "passwordSecret"),
    ({"endpoints": ["http://e:2379"], "placementTTLSeconds": -5}, "placementTTLSeconds"),
    ({"endpoints": ["http://e:2379"], "tls": {"caSecrets": "x"}}, "caSecrets"),
])
def test_a_bad_etcd_spec_is_refused_naming_the_field(etcd: dict[str, Any], field: str) -> None:
    _, errors = admit_custom_resource(manifest(etcd=etcd), SCHEMA)
    pruned_away = field == "caSecrets"  # the API server prunes an unknown field; the operator's model refuses it
    assert pruned_away or any(field in e for e in errors), errors
    plan = reconcile_serving(manifest(etcd=etcd), {}, [], NOW)
    assert plan.children == [] and field in str(plan.status)


def test_chart_values_reach_the_ranking_service_and_its_pods() -> None:
    values = {"operator": {"enabled": False},
              "etcd": {**SECURE, "auth": {"user": "grs", "passwordSecret": "etcd-pw", "passwordKey": "pw"}},
              "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://models/hstu/model.pt"}}}
    docs = render(values)
    (svc,) = [d for d in docs if d["kind"] == names.SERVING_KIND]
    assert svc["spec"]["etcd"] == SECURE
    stored, errors = admit_custom_resource(svc, SCHEMA)
    assert errors == []
    GRRankingServiceSpec.model_validate(stored["spec"])
    stored["metadata"].update(uid="u", generation=1)
    plan = reconcile_serving(stored, {}, [], NOW)
    for pod in pods_of(plan):
        args = pod["containers"][0]["args"]
        assert all(flag in args for flag in CLIENT_FLAGS[::2])
    for child in plan.children:  # what the operator creates is valid Kubernetes
        if child["kind"] in ("StatefulSet", "Deployment"):
            kubernetes_validate.validate(child, "1.30", strict=True)
    # A service's own spec.etcd settings win over the chart-wide ones.
    own = {"endpoints": ["http://other:2379"], "tls": {"caSecret": "own-ca"}}
    (svc,) = [d for d in render({**values, "rankingService": {"enabled": True, "spec": {
        "checkpoint": "s3://m/x.pt", "etcd": own}}}) if d["kind"] == names.SERVING_KIND]
    assert svc["spec"]["etcd"]["endpoints"] == ["http://other:2379"]
    assert svc["spec"]["etcd"]["tls"] == {"caSecret": "own-ca"}
    assert svc["spec"]["etcd"]["auth"]["user"] == "grs"


def pods_of(plan: Any) -> list[dict[str, Any]]:
    return [c["spec"]["template"]["spec"] for c in plan.children if c["kind"] in ("StatefulSet", "Deployment")
            and c["metadata"]["name"] != "rank-etcd"]


@pytest.mark.parametrize("etcd, message", [
    ({"enabled": True, "auth": {"user": "grs", "passwordSecret": "pw"}}, "bundled etcd"),
    ({"enabled": True, "tls": {"caSecret": "ca"}}, "bundled etcd"),
    ({"endpoints": ["https://e:2379"], "auth": {"user": "grs"}}, "passwordSecret is required"),
    ({"tls": {"caSecret": "Not_A_Name"}}, "caSecret"),
    ({"placementTTLSeconds": -1}, "placementTTLSeconds"),
    ({"tls": {"ca": "x"}}, "ca"),
])
def test_chart_refuses_bad_etcd_values(etcd: dict[str, Any], message: str) -> None:
    values = {"operator": {"enabled": False}, "etcd": etcd,
              "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://models/hstu/model.pt"}}}
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_chart_lints_with_etcd_client_settings() -> None:
    values = {"operator": {"enabled": False}, "etcd": SECURE,
              "rankingService": {"enabled": True, "spec": {"checkpoint": "s3://models/hstu/model.pt"}}}
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report

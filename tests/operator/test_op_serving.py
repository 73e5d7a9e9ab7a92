"""Table-driven tests of the pure GRRankingService reconcile."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
import yaml

from grstack.operator import names
from grstack.operator.models import GRRankingServiceStatus
from grstack.operator.serving import hit_rate, reconcile_serving

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def svc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "prod", "uid": "uid-9", "generation": 2},
            "spec": {"image": "grstack:cpu", "checkpoint": {"path": "/models/best.pt", "claimName": "models"},
                     **spec}}


def ready(kind: str, name: str, n: int, replicas: int | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    return {(kind, name): {"status": {"readyReplicas": n, "replicas": n if replicas is None else replicas}}}


def kinds(plan: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in plan.children}


def test_children_for_a_minimal_service() -> None:
    plan = reconcile_serving(svc(), {}, [], NOW)
    assert set(kinds(plan)) == {("ConfigMap", "rank-serve"), ("ServiceAccount", "rank-serve"), ("Role", "rank-serve"),
                                ("RoleBinding", "rank-serve"), ("Service", "rank-ranker"),
                                ("StatefulSet", "rank-ranker"), ("Deployment", "rank-router"), ("Service", "rank")}
    sts = kinds(plan)[("StatefulSet", "rank-ranker")]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["serve", "ranker", "--checkpoint", "/models/best.pt", "--port", "8000"]
    assert sts["spec"]["serviceName"] == "rank-ranker" and sts["spec"]["replicas"] == 1
    router = kinds(plan)[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == ["serve", "router", "--rankers", "http://rank-ranker-0.rank-ranker:8000",
                              "--port", "8080"]
    settings = yaml.safe_load(kinds(plan)[("ConfigMap", "rank-serve")]["data"]["serve.yaml"])
    assert settings["cache"] == {"device_bytes": 1 << 30, "dram_bytes": 4 << 30, "ttl_seconds": 600}
    assert settings["trigger"]["slo_ms"] == 50.0
    role = kinds(plan)[("Role", "rank-serve")]
    assert role["rules"][0]["resourceNames"] == ["rank-ranker-0"]
    assert plan.status["url"] == "http://rank.prod.svc:8080"
    assert plan.status["selector"] == f"{names.LABEL_SERVICE}=rank,{names.LABEL_COMPONENT}=ranker"


def test_etcd_modes() -> None:
    managed = kinds(reconcile_serving(svc(etcd={"managed": True}, replicas=3), {}, [], NOW))
    assert ("StatefulSet", "rank-etcd") in managed and ("Service", "rank-etcd") in managed
    router = managed[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][2:4] == ["--etcd", "http://rank-etcd:2379"]
    ranker = managed[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]["containers"][0]
    assert "--etcd" in ranker["args"]
    external = kinds(reconcile_serving(svc(etcd={"endpoints": ["http://etcd:2379"]}), {}, [], NOW))
    assert ("StatefulSet", "rank-etcd") not in external
    both = reconcile_serving(svc(etcd={"endpoints": ["http://etcd:2379"], "managed": True}), {}, [], NOW)
    assert both.children == [] and "either managed or endpoints" in json.dumps(both.status)


def test_autoscaling_targets_the_scale_subresource() -> None:
    plan = reconcile_serving(svc(replicas=2, autoscaling={"minReplicas": 2, "maxReplicas": 5}), {}, [], NOW)
    hpa = kinds(plan)[("HorizontalPodAutoscaler", "rank-ranker")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": names.API_VERSION, "kind": "GRRankingService",
                                             "name": "rank"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    role = kinds(plan)[("Role", "rank-serve")]
    assert role["rules"][0]["resourceNames"] == [f"rank-ranker-{i}" for i in range(5)]
    removed = reconcile_serving(svc(), {("HorizontalPodAutoscaler", "rank-ranker"): {}}, [], NOW)
    assert removed.delete == [("autoscaling/v2", "HorizontalPodAutoscaler", "rank-ranker")]


READY_CASES = [
    ("nothing running", {}, False, "RankersNotReady"),
    ("rankers but no router", ready("StatefulSet", "rank-ranker", 2), False, "RoutersNotReady"),
    ("one of two rankers", ready("StatefulSet", "rank-ranker", 1) | ready("Deployment", "rank-router", 1), False,
     "RankersNotReady"),
    ("all ready", ready("StatefulSet", "rank-ranker", 2) | ready("Deployment", "rank-router", 1), True,
     "AllReplicasReady"),
]


@pytest.mark.parametrize(("name", "observed", "is_ready", "reason"), READY_CASES, ids=[c[0] for c in READY_CASES])
def test_ready_rollup(name: str, observed: dict[tuple[str, str], Any], is_ready: bool, reason: str) -> None:
    plan = reconcile_serving(svc(replicas=2), observed, [], NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert (cond["status"], cond["reason"]) == ("True" if is_ready else "False", reason)
    GRRankingServiceStatus.model_validate(plan.status)


def test_managed_etcd_gates_readiness() -> None:
    observed = ready("StatefulSet", "rank-ranker", 1) | ready("Deployment", "rank-router", 1)
    plan = reconcile_serving(svc(etcd={"managed": True}), observed, [], NOW)
    assert next(c for c in plan.status["conditions"] if c["type"] == "Ready")["reason"] == "EtcdNotReady"
    plan = reconcile_serving(svc(etcd={"managed": True}), observed | ready("StatefulSet", "rank-etcd", 1), [], NOW)
    assert next(c for c in plan.status["conditions"] if c["type"] == "Ready")["status"] == "True"


def _ranker(stats: dict[str, Any] | str | None) -> dict[str, Any]:
    ann = {} if stats is None else {names.ANNOTATION_STATS: stats if isinstance(stats, str) else json.dumps(stats)}
    return {"metadata": {"labels": {names.LABEL_COMPONENT: "ranker"}, "annotations": ann}}


@pytest.mark.parametrize(("pods", "expected"), [
    ([], None),
    ([_ranker({"cache_hits": 30, "cache_lookups": 40}), _ranker({"cache_hits": 10, "cache_lookups": 60})], 0.4),
    ([_ranker({"cache_hit_rate": 0.5}), _ranker({"cache_hit_rate": 0.7})], 0.6),
    ([_ranker("{broken"), _ranker(None)], None),
])
def test_hit_rate(pods: list[dict[str, Any]], expected: float | None) -> None:
    assert hit_rate(pods) == expected


def test_invalid_spec_creates_nothing() -> None:
    plan = reconcile_serving(svc(replicas=0), {}, [], NOW)
    cond = plan.status["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("Ready", "False", "InvalidSpec")
    assert "spec.replicas" in cond["message"] and plan.children == []
    assert plan.events[0][1] == "InvalidSpec"


def test_scaling_propagates_to_the_statefulset() -> None:
    plan = reconcile_serving(svc(replicas=4), ready("StatefulSet", "rank-ranker", 2, replicas=2), [], NOW)
    assert kinds(plan)[("StatefulSet", "rank-ranker")]["spec"]["replicas"] == 4
    assert plan.status["replicas"] == 2 and plan.status["readyReplicas"] == 2

"""Table-driven tests of the pure GRRankingService reconcile."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from grstack.operator import names
from grstack.operator.models import GRRankingServiceStatus
from grstack.operator.serving import hit_rate, reconcile_serving, stats_targets

pytestmark = pytest.mark.unit

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
    assert set(kinds(plan)) == {("Service", "rank-ranker"), ("StatefulSet", "rank-ranker"),
                                ("Deployment", "rank-router"), ("Service", "rank")}
    sts = kinds(plan)[("StatefulSet", "rank-ranker")]
    pod = sts["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == [
        "serve", "ranker", "--checkpoint", "/models/best.pt", "--host", "0.0.0.0", "--port", "8000",
        "--device", "cpu", "--device-cache-mb", "1024", "--dram-cache-mb", "4096", "--dram-ttl-s", "600"]
    assert pod["automountServiceAccountToken"] is False  # no API access for serving pods
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert sts["spec"]["serviceName"] == "rank-ranker" and sts["spec"]["replicas"] == 1
    router = kinds(plan)[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == ["serve", "router", "--rankers", "http://rank-ranker-0.rank-ranker:8000",
                              "--host", "0.0.0.0", "--port", "8080", "--slo-ms", "50", "--prefill-budget-ms", "500",
                              "--cache-budget-mb", "1024", "--footprint-ttl-s", "600"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert plan.status["url"] == "http://rank.prod.svc:8080"
    assert plan.status["selector"] == f"{names.LABEL_SERVICE}=rank,{names.LABEL_COMPONENT}=ranker"


def test_trigger_and_cache_become_flags() -> None:
    plan = reconcile_serving(svc(replicas=3, ranker={"accelerator": "nvidia"},
                                 cache={"deviceBytes": 512 << 20, "dramBytes": 1 << 30, "ttlSeconds": 60},
                                 trigger={"sloMs": 20, "lengthThreshold": 256, "preInferBudget": 0.25}), {}, [], NOW)
    ranker = kinds(plan)[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]["containers"][0]
    assert ranker["args"][ranker["args"].index("--device") + 1] == "cuda"
    assert ranker["args"][ranker["args"].index("--device-cache-mb") + 1] == "512"
    assert ranker["resources"]["limits"]["nvidia.com/gpu"] == 1
    router = kinds(plan)[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = dict(zip(router[4::2], router[5::2], strict=False))
    assert flags["--slo-ms"] == "20" and flags["--length-threshold"] == "256"
    assert flags["--prefill-budget-ms"] == "250" and flags["--cache-budget-mb"] == "1536"
    assert router[2] == "--rankers" and len(router[3].split(",")) == 3


def test_etcd_modes() -> None:
    managed = kinds(reconcile_serving(svc(etcd={"managed": True}, replicas=3), {}, [], NOW))
    assert ("StatefulSet", "rank-etcd") in managed and ("Service", "rank-etcd") in managed
    router = managed[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][2:6] == ["--etcd", "http://rank-etcd:2379", "--etcd-root", "/grstack/ranking/prod/rank"]
    ranker = managed[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ranker[ranker.index("--etcd"):] == [
        "--etcd", "http://rank-etcd:2379", "--etcd-root", "/grstack/ranking/prod/rank",
        "--replica-id", "$(GRSTACK_POD_NAME)", "--advertise-url", "http://$(GRSTACK_POD_NAME).rank-ranker:8000"]
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


@pytest.mark.parametrize(("stats", "expected"), [
    ([], None),
    ([{"device_hits": 20, "dram_hits": 10, "misses": 10}, {"device_hits": 10, "dram_hits": 0, "misses": 50}], 0.4),
    ([{"device_hits": 0, "dram_hits": 0, "misses": 0}], None),
    ([{"device_hits": "x"}, {"device_hits": 3, "misses": 1}], 0.75),
])
def test_hit_rate(stats: list[dict[str, Any]], expected: float | None) -> None:
    assert hit_rate(stats) == expected


def test_stats_are_polled_from_running_rankers_only() -> None:
    def pod(component: str, phase: str, ip: str | None) -> dict[str, Any]:
        return {"metadata": {"labels": {names.LABEL_COMPONENT: component}},
                "status": {"phase": phase, **({"podIP": ip} if ip else {})}}

    pods = [pod("ranker", "Running", "10.0.0.5"), pod("ranker", "Pending", None), pod("router", "Running", "10.0.0.6"),
            pod("ranker", "Running", "fd00::7")]
    assert stats_targets(svc(ranker={"port": 9000}), pods) == ["http://10.0.0.5:9000/v1/stats",
                                                               "http://[fd00::7]:9000/v1/stats"]
    plan = reconcile_serving(svc(), {}, [{"device_hits": 1, "dram_hits": 0, "misses": 3}], NOW)
    assert plan.status["cacheHitRate"] == 0.25


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

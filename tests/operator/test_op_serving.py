"""Table-driven tests of the pure GRRankingService reconcile."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from grstack.operator import names
from grstack.operator.models import GRRankingServiceSpec, GRRankingServiceStatus
from grstack.operator.serving import HitRateWindow, hit_rate, reconcile_serving, router_args, stats_targets

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def svc(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": "rank", "namespace": "prod", "uid": "uid-9", "generation": 2},
            "spec": {"image": "grstack:cpu", "checkpoint": {"path": "/models/best.pt", "claimName": "models"},
                     **spec}}


def ready(kind: str, name: str, n: int, replicas: int | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """A child whose rollout is done with ``n`` ready pods (no spec: taken to be the desired one)."""
    return {(kind, name): {"status": {"readyReplicas": n, "availableReplicas": n, "updatedReplicas": n,
                                      "replicas": n if replicas is None else replicas}}}


def kinds(plan: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(c["kind"], c["metadata"]["name"]): c for c in plan.children}


def test_children_for_a_minimal_service() -> None:
    plan = reconcile_serving(svc(), {}, [], NOW)
    assert set(kinds(plan)) == {("Service", "rank-ranker"), ("StatefulSet", "rank-ranker"),
                                ("Deployment", "rank-router"), ("Service", "rank"),
                                ("PodDisruptionBudget", "rank-ranker"), ("PodDisruptionBudget", "rank-router")}
    sts = kinds(plan)[("StatefulSet", "rank-ranker")]
    pod = sts["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == [
        "serve", "ranker", "--checkpoint", "/models/best.pt", "--host", "0.0.0.0", "--port", "8000",
        "--device", "cpu", "--device-cache-mb", "1024", "--dram-cache-mb", "4096", "--dram-ttl-s", "600"]
    assert pod["automountServiceAccountToken"] is False  # no API access for serving pods
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert sts["spec"]["serviceName"] == "rank-ranker" and sts["spec"]["replicas"] == 1
    router = kinds(plan)[("Deployment", "rank-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == ["serve", "router", "--rankers-dns", "rank-ranker:8000",
                              "--host", "0.0.0.0", "--port", "8080", "--slo-ms", "50", "--prefill-budget-ms", "500",
                              "--cache-budget-per-replica-mb", "1024", "--footprint-ttl-s", "600"]
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
    assert flags["--prefill-budget-ms"] == "250" and flags["--cache-budget-per-replica-mb"] == "512"
    assert router[2:4] == ["--rankers-dns", "rank-ranker:8000"]


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
    plan = reconcile_serving(svc(replicas=2, autoscaling={"minReplicas": 2, "maxReplicas": 5},
                                 ranker={"resources": {"requests": {"cpu": "2"}}}), {}, [], NOW)
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
    window = HitRateWindow()
    first = reconcile_serving(svc(), {}, [{"device_hits": 1, "dram_hits": 0, "misses": 3, "_target": "a"}], NOW,
                              window)
    assert "cacheHitRate" not in first.status  # no baseline yet: counters since ranker start are not a rate
    later = NOW + dt.timedelta(seconds=10)
    plan = reconcile_serving(svc(), {}, [{"device_hits": 4, "dram_hits": 0, "misses": 4, "_target": "a"}], later,
                             window)
    assert plan.status["cacheHitRate"] == 0.75  # 3 hits of 4 lookups since the first sample


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


def test_hit_rate_is_windowed_not_cumulative() -> None:
    """A long good past does not hide a bad present: the rate covers the window only, per ranker, and a
    restarted ranker (counters going down) counts from zero."""
    w = HitRateWindow(seconds=60)
    assert w.add(0, {"a": (9000, 10000)}) == (False, None)
    assert w.add(30, {"a": (9000, 10100)}) == (True, 0.0)  # 100 misses since t=0
    assert w.add(90, {"a": (9000, 10200)}) == (True, 0.0)  # baseline moved to t=30
    assert [t for t, _ in w.samples] == [30, 90]
    assert w.add(120, {"a": (50, 100), "b": (10, 10)}) == (True, 0.5455)  # a restarted, b is new: 60/110
    assert w.add(200, {"a": (50, 100), "b": (10, 10)}) == (True, None)  # nothing looked up in the window


def test_router_args_do_not_depend_on_the_ranker_count() -> None:
    """Scaling rankers changes the StatefulSet only: the router pod template stays the same, so routers are
    not rolled (they find rankers through the headless Service or etcd)."""
    for etcd in ({}, {"managed": True}, {"endpoints": ["http://etcd:2379"]}):
        templates = []
        for replicas in (1, 2, 7):
            plan = reconcile_serving(svc(replicas=replicas, etcd=etcd), {}, [], NOW)
            templates.append(kinds(plan)[("Deployment", "rank-router")]["spec"]["template"])
        assert templates[0] == templates[1] == templates[2], etcd
    spec = GRRankingServiceSpec.model_validate(svc()["spec"])
    assert "--rankers" not in router_args("rank", "prod", spec)


def test_autoscaling_requires_a_cpu_request() -> None:
    plan = reconcile_serving(svc(autoscaling={"maxReplicas": 3}), {}, [], NOW)
    cond = plan.status["conditions"][0]
    assert (cond["reason"], plan.children) == ("InvalidSpec", [])
    assert "ranker.resources.requests.cpu" in cond["message"]
    ok = reconcile_serving(svc(autoscaling={"maxReplicas": 3}, ranker={"resources": {"requests": {"cpu": "500m"}}}),
                           {}, [], NOW)
    assert ("HorizontalPodAutoscaler", "rank-ranker") in kinds(ok)


def _rolled(plan: Any, key: tuple[str, str], **status: Any) -> dict[tuple[str, str], dict[str, Any]]:
    obj = json.loads(json.dumps(kinds(plan)[key]))
    obj["metadata"]["generation"] = status.pop("generation", 1)
    obj["status"] = {"observedGeneration": 1, **status}
    return {key: obj}


ROLLOUT = [
    ("rolled out", {}, {}, True, ""),
    ("new generation not observed", {"generation": 2}, {}, False, "generation 2 not observed"),
    ("one updated", {"updatedReplicas": 1}, {}, False, "1/2 updated and available"),
    ("old pod left", {"replicas": 3}, {}, False, "1 old"),
    ("template changed, not applied yet", {}, {"image": "grstack:new"}, False, "being updated"),
]


@pytest.mark.parametrize(("name", "sts_status", "change", "is_ready", "message"), ROLLOUT,
                         ids=[c[0] for c in ROLLOUT])
def test_ready_follows_rollout(name: str, sts_status: dict[str, Any], change: dict[str, Any], is_ready: bool,
                               message: str) -> None:
    base = reconcile_serving(svc(replicas=2), {}, [], NOW)
    full = {"replicas": 2, "readyReplicas": 2, "availableReplicas": 2, "updatedReplicas": 2}
    observed = _rolled(base, ("StatefulSet", "rank-ranker"), **{**full, **sts_status}) | _rolled(
        base, ("Deployment", "rank-router"), replicas=1, readyReplicas=1, availableReplicas=1, updatedReplicas=1)
    plan = reconcile_serving(svc(replicas=2, **change), observed, [], NOW)
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert cond["status"] == ("True" if is_ready else "False"), cond
    assert message in cond["message"]


URI_CASES = [
    ("pvc://models/hstu/model.pt", "/mnt/models/hstu/model.pt", "persistentVolumeClaim", None),
    ("s3://bucket/exports/model.pt", "/mnt/models/model.pt", "emptyDir", "s3://bucket/exports/model.pt"),
    ("gs://bucket/run-7/", "/mnt/models", "emptyDir", "gs://bucket/run-7/"),
    ("https://example.com/m/best.pt?sig=1", "/mnt/models/best.pt", "emptyDir", "https://example.com/m/best.pt?sig=1"),
]


@pytest.mark.parametrize(("uri", "path", "volume", "fetched"), URI_CASES, ids=[c[0].split(":")[0] for c in URI_CASES])
def test_storage_uri_checkpoint(uri: str, path: str, volume: str, fetched: str | None) -> None:
    spec = {"checkpoint": uri, "storage": {"secretName": "s3-creds"}}
    plan = reconcile_serving({**svc(), "spec": {"image": "grstack:cpu", **spec}}, {}, [], NOW)
    pod = kinds(plan)[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--checkpoint") + 1] == path
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume in model
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    if fetched is None:
        assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert "initContainers" not in pod
        return
    (init,) = pod["initContainers"]
    assert init["args"] == [fetched, "/mnt/models"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert {"name": "storage-secret", "secret": {"secretName": "s3-creds"}} in pod["volumes"]
    gcreds = [e for e in init["env"] if e["name"] == "GOOGLE_APPLICATION_CREDENTIALS"]
    assert bool(gcreds) == uri.startswith("gs://")


def test_storage_uri_without_a_secret() -> None:
    plan = reconcile_serving({**svc(), "spec": {"image": "i", "checkpoint": "https://h/m.pt"}}, {}, [], NOW)
    pod = kinds(plan)[("StatefulSet", "rank-ranker")]["spec"]["template"]["spec"]
    assert "envFrom" not in pod["initContainers"][0]
    assert not any(v["name"] == "storage-secret" for v in pod["volumes"])


@pytest.mark.parametrize("bad", ["ftp://x/y", "models/best.pt", "pvc://", "s3://", ""])
def test_invalid_storage_uri(bad: str) -> None:
    plan = reconcile_serving({**svc(), "spec": {"image": "i", "checkpoint": bad}}, {}, [], NOW)
    assert plan.status["conditions"][0]["reason"] == "InvalidSpec" and plan.children == []


def test_disruption_budgets() -> None:
    plan = reconcile_serving(svc(disruptionBudget={"maxUnavailable": "25%"}), {}, [], NOW)
    pdb = kinds(plan)[("PodDisruptionBudget", "rank-ranker")]
    assert pdb["spec"] == {"maxUnavailable": "25%", "selector": {"matchLabels": {
        names.LABEL_SERVICE: "rank", names.LABEL_COMPONENT: "ranker"}}}
    assert kinds(plan)[("PodDisruptionBudget", "rank-router")]["spec"]["selector"]["matchLabels"][
        names.LABEL_COMPONENT] == "router"
    off = reconcile_serving(svc(disruptionBudget={"enabled": False}),
                            {("PodDisruptionBudget", "rank-ranker"): {}, ("PodDisruptionBudget", "rank-router"): {}},
                            [], NOW)
    assert not any(k[0] == "PodDisruptionBudget" for k in kinds(off))
    assert off.delete == [("policy/v1", "PodDisruptionBudget", "rank-ranker"),
                          ("policy/v1", "PodDisruptionBudget", "rank-router")]

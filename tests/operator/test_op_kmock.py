"""``grstack operator`` against KMock with the local kubelet: the lifecycle rules end to end.

Pods run ``fake_trainer.py`` (same arguments, checkpoints, resume and progress reports as ``grstack train``,
failures on demand) so these stay fast; ``test_op_e2e.py`` runs the real trainer.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import fake_trainer
import pytest
from aiohttp import web
from opsim import Cluster

from grstack.operator import names

pytestmark = pytest.mark.e2e

JOBS = f"{names.GROUP}/{names.VERSION}/{names.TRAINING_PLURAL}"
SERVICES = f"{names.GROUP}/{names.VERSION}/{names.SERVING_PLURAL}"


def job(name: str, replicas: int = 1, env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    spec.setdefault("image", "grstack:test")
    spec.setdefault("progressIntervalSeconds", 1)
    spec.setdefault("checkpoint", {"claimName": "ckpt"})
    spec["workers"] = {"replicas": replicas, "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    return {"apiVersion": names.API_VERSION, "kind": names.TRAINING_KIND,
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def status(c: Cluster, name: str, plural: str = JOBS) -> dict[str, Any]:
    return (c.get(plural, name) or {}).get("status") or {}


def condition(c: Cluster, name: str, type_: str, plural: str = JOBS) -> dict[str, Any]:
    return next((x for x in status(c, name, plural).get("conditions", []) if x["type"] == type_), {})


def events(c: Cluster, name: str, reason: str) -> list[str]:
    """Messages of the Kubernetes Events the operator posted about ``name`` with ``reason``."""
    return [e.get("message", "") for e in c.server.live("v1/events")
            if e.get("involvedObject", {}).get("name") == name and e.get("reason") == reason]


async def metrics_show(c: Cluster, *lines: str) -> None:
    """Waits until the operator's /metrics contains every line (metrics follow the API writes)."""
    text = ""
    for _ in range(100):
        text = await c.op.metrics()
        if all(line in text for line in lines):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{lines} not in metrics:\n{text}")


async def create(c: Cluster, obj: dict[str, Any]) -> None:
    code, body = await c.apply(obj)
    assert code in (200, 201), body


async def test_job_succeeds_with_progress_metrics_and_liveness(cluster: Cluster) -> None:
    await create(cluster, job("ok", replicas=2))
    await cluster.wait_for("Succeeded", lambda: status(cluster, "ok").get("state") == "Succeeded")
    st = status(cluster, "ok")
    assert st["progress"]["step"] == 6 and st["progress"]["summary"] == "100% (6/6)"
    assert st["progress"]["metrics"] == {"ndcg@10": 0.5}
    assert st["progress"]["lastCheckpoint"].endswith("checkpoint.json")
    assert cluster.states(JOBS, "ok")[0] == "Created" and st["startTime"] and st["completionTime"]
    assert len(cluster.pods(names.LABEL_JOB, "ok")) == 2  # cleanPodPolicy None keeps them
    for kind, name in (("v1/configmaps", "ok-config"), ("v1/services", "ok-workers"),
                       ("rbac.authorization.k8s.io/v1/roles", "ok-worker")):
        assert cluster.get(kind, name) is not None
    await metrics_show(cluster, 'grstack_operator_training_jobs{state="Succeeded"} 1.0',
                       "grstack_operator_pods_created_total 2.0")
    assert (await cluster.op.get(cluster.op.liveness))[0] == 200


async def test_crashed_worker_restarts_the_gang_from_the_checkpoint(cluster: Cluster) -> None:
    await create(cluster, job("crash", replicas=2, env={"FAKE_CRASH_AT": "5", "FAKE_STEPS": "8"}))
    await cluster.wait_for("Succeeded", lambda: status(cluster, "crash").get("state") == "Succeeded")
    st = status(cluster, "crash")
    assert st["restarts"] == 1 and st["progress"]["step"] == 8
    assert "Restarting" in cluster.states(JOBS, "crash")
    assert condition(cluster, "crash", "Restarting")["status"] == "False"
    await cluster.wait_for("the event", lambda: any("crash-worker-0 failed with exit status 1" in m
                                                    and "crash at step 5" in m
                                                    for m in events(cluster, "crash", "Restarting")))
    starts = (cluster.root / "pvc" / "default" / "ckpt" / "crash" / "starts").read_text().split("\n")
    assert "crash-worker-0 4" in starts  # attempt 2 resumed from the step-4 checkpoint
    pods = cluster.pods(names.LABEL_JOB, "crash")
    assert {p["metadata"]["labels"][names.LABEL_ATTEMPT] for p in pods} == {"1"}
    await metrics_show(cluster, "grstack_operator_gang_restarts_total 1.0")


def test_a_rank_starting_while_rank_0_checkpoints_reads_a_whole_checkpoint(tmp_path: Path) -> None:
    """How the crash test can count 2 restarts on a loaded machine: a rank 1 that starts late reads the
    checkpoint while rank 0 is rewriting it (truncate, then write), fails to parse it and exits 1, a real
    second worker failure (of the fake). The fake now replaces files atomically, as the trainer does."""
    ckpt = tmp_path / "checkpoint.json"
    stop = threading.Event()

    def rank0() -> None:
        step = 0
        while not stop.is_set():
            step += 2
            fake_trainer.write_atomically(ckpt, json.dumps({"step": step}))

    writer = threading.Thread(target=rank0)
    writer.start()
    try:
        steps = [fake_trainer.read_step(ckpt) for _ in range(20000)]  # JSONDecodeError on a torn read
    finally:
        stop.set()
        writer.join()
    assert all(s % 2 == 0 for s in steps) and steps == sorted(steps)


async def test_killed_worker_restarts(cluster: Cluster) -> None:
    await create(cluster, job("kill", replicas=2, env={"FAKE_STEPS": "12", "FAKE_STEP_SECONDS": "0.3"}))
    await cluster.wait_for("a checkpoint", lambda: (status(cluster, "kill").get("progress") or {})
                           .get("lastCheckpoint"))
    cluster.kubelet.kill("kill-worker-1")
    await cluster.wait_for("Succeeded", lambda: status(cluster, "kill").get("state") == "Succeeded", timeout=90)
    assert status(cluster, "kill")["restarts"] == 1
    await cluster.wait_for("the event", lambda: any("kill-worker-1 failed with exit status 137" in m
                                                    for m in events(cluster, "kill", "Restarting")))


async def test_deleted_worker_restarts_the_gang(cluster: Cluster) -> None:
    await create(cluster, job("evict", replicas=2, env={"FAKE_STEPS": "12", "FAKE_STEP_SECONDS": "0.3"}))
    await cluster.wait_for("all running", lambda: status(cluster, "evict").get("gangAttempt") == 0
                           and status(cluster, "evict").get("state") == "Running")
    await cluster.delete("v1/pods", "evict-worker-1")  # e.g. evicted from a drained node
    await cluster.wait_for("Succeeded", lambda: status(cluster, "evict").get("state") == "Succeeded", timeout=90)
    assert status(cluster, "evict")["restarts"] == 1
    await cluster.wait_for("the event", lambda: any("evict-worker-1 disappeared" in m
                                                    for m in events(cluster, "evict", "Restarting")))


async def test_backoff_limit_and_user_errors_fail(cluster: Cluster) -> None:
    await create(cluster, job("flaky", env={"FAKE_CRASH_AT": "1", "FAKE_CRASHES": "9"},
                              runPolicy={"backoffLimit": 1}))
    await create(cluster, job("usererr", env={"FAKE_EXIT": "2"}))
    await cluster.wait_for("flaky Failed", lambda: status(cluster, "flaky").get("state") == "Failed", timeout=90)
    await cluster.wait_for("usererr Failed", lambda: status(cluster, "usererr").get("state") == "Failed")
    assert condition(cluster, "flaky", "Failed")["reason"] == "BackoffLimitExceeded"
    assert status(cluster, "flaky")["restarts"] == 1
    failed = condition(cluster, "usererr", "Failed")
    assert failed["reason"] == "UserError" and "invalid on purpose" in failed["message"]
    assert status(cluster, "usererr")["restarts"] == 0


async def test_invalid_jobs_are_rejected_with_a_message(cluster: Cluster) -> None:
    code, body = await cluster.apply(job("bad", replicas=0))  # the CRD schema: the API server says no
    assert code == 422 and "spec.workers.replicas" in body["message"]
    await create(cluster, job("badcfg", overrides={"train.epochz": 2}))  # only the trainer's model knows
    await cluster.wait_for("InvalidSpec", lambda: condition(cluster, "badcfg", "Failed").get("reason") == "InvalidSpec")
    assert "train.epochz" in condition(cluster, "badcfg", "Failed")["message"]
    assert cluster.pods(names.LABEL_JOB, "badcfg") == []
    await cluster.wait_for("the event", lambda: any("train.epochz: unknown key" in m
                                                    for m in events(cluster, "badcfg", "InvalidSpec")))
    # The create handler failed permanently: kopf does not retry it.
    await cluster.wait_for("kopf's verdict", lambda: "failed permanently: invalid spec" in cluster.op.log.read_text())
    assert "will retry" not in cluster.op.log.read_text()


async def test_deleting_the_job_removes_its_pods(cluster: Cluster) -> None:
    await create(cluster, job("gone", replicas=2, env={"FAKE_HANG_AT": "2"}))
    await cluster.wait_for("running", lambda: status(cluster, "gone").get("state") == "Running")
    processes = [cluster.kubelet.pod(f"gone-worker-{r}").process for r in range(2)]
    await cluster.delete(JOBS, "gone")
    await cluster.wait_for("job gone", lambda: cluster.get(JOBS, "gone") is None)
    await cluster.wait_for("pods gone", lambda: cluster.pods(names.LABEL_JOB, "gone") == [])
    await cluster.wait_for("children gone", lambda: cluster.get("v1/configmaps", "gone-config") is None)
    await cluster.wait_for("processes ended", lambda: all(p.returncode is not None for p in processes))


async def test_suspend_and_resume(cluster: Cluster) -> None:
    await create(cluster, job("pause", env={"FAKE_STEPS": "10", "FAKE_STEP_SECONDS": "0.2"}))
    await cluster.wait_for("a checkpoint", lambda: (status(cluster, "pause").get("progress") or {})
                           .get("lastCheckpoint"))
    await cluster.patch(JOBS, "pause", {"spec": {"runPolicy": {"suspend": True}}})
    await cluster.wait_for("Suspended", lambda: status(cluster, "pause").get("state") == "Suspended")
    await cluster.wait_for("no pods", lambda: cluster.pods(names.LABEL_JOB, "pause") == [])
    await cluster.patch(JOBS, "pause", {"spec": {"runPolicy": {"suspend": False}}})
    await cluster.wait_for("Succeeded", lambda: status(cluster, "pause").get("state") == "Succeeded", timeout=90)
    assert condition(cluster, "pause", "Suspended")["reason"] == "JobResumed"
    starts = (cluster.root / "pvc" / "default" / "ckpt" / "pause" / "starts").read_text().split()
    assert int(starts[-1]) >= 2  # resumed from a checkpoint, not from step 0


async def test_deadline_and_ttl(cluster: Cluster) -> None:
    await create(cluster, job("slow", env={"FAKE_HANG_AT": "1"}, runPolicy={"activeDeadlineSeconds": 2}))
    await create(cluster, job("short", runPolicy={"ttlSecondsAfterFinished": 0}))
    await cluster.wait_for("DeadlineExceeded", lambda: condition(cluster, "slow", "Failed").get("reason")
                           == "DeadlineExceeded", timeout=90)
    await cluster.wait_for("slow pods deleted", lambda: cluster.pods(names.LABEL_JOB, "slow") == [])
    await cluster.wait_for("short deleted after its TTL", lambda: cluster.get(JOBS, "short") is None)
    assert "Succeeded" in cluster.states(JOBS, "short")


def ranking_service(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": names.API_VERSION, "kind": names.SERVING_KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"image": "grstack:test", "checkpoint": {"path": "/models/best.pt"}, **spec}}


async def stats_server(counters: dict[str, int]) -> tuple[web.AppRunner, int]:
    """A stand-in ranker answering GET /v1/stats like ``grstack serve ranker``."""
    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"replica": "r0", **counters})

    app = web.Application()
    app.router.add_get("/v1/stats", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def test_ranking_service_children_readiness_scaling_and_hit_rate(cluster: Cluster) -> None:
    cluster.kubelet.enabled = False  # rankers/routers are not run here; their controllers are simulated
    counters = {"device_hits": 6, "dram_hits": 2, "misses": 2}
    runner, port = await stats_server(counters)
    await create(cluster, ranking_service("rank", replicas=2, ranker={"port": port}, hitRateWindowSeconds=10))
    await cluster.wait_for("StatefulSet", lambda: cluster.get("apps/v1/statefulsets", "rank-ranker"))
    await cluster.wait_for("not ready", lambda: condition(cluster, "rank", "Ready", SERVICES).get("reason")
                           == "RankersNotReady")
    assert status(cluster, "rank", SERVICES)["url"] == "http://rank.default.svc:8080"
    assert cluster.get("apps/v1/deployments", "rank-router") and cluster.get("v1/services", "rank")
    assert cluster.get("policy/v1/poddisruptionbudgets", "rank-ranker")
    assert cluster.get("policy/v1/poddisruptionbudgets", "rank-router")
    # What the StatefulSet and Deployment controllers would report: ready but not rolled out is not Ready.
    await cluster.patch("apps/v1/statefulsets", "rank-ranker", {"status": {"replicas": 2, "readyReplicas": 2}},
                        sub="status")
    await cluster.patch("apps/v1/deployments", "rank-router", {"status": {"replicas": 1, "readyReplicas": 1}},
                        sub="status")
    await cluster.wait_for("not rolled out", lambda: "generation 1 not observed" in condition(
        cluster, "rank", "Ready", SERVICES).get("message", ""))
    for path, name, n in (("apps/v1/statefulsets", "rank-ranker", 2), ("apps/v1/deployments", "rank-router", 1)):
        generation = cluster.get(path, name)["metadata"].get("generation", 1)
        await cluster.patch(path, name, {"status": {"observedGeneration": generation, "replicas": n,
                                                    "readyReplicas": n, "updatedReplicas": n,
                                                    "availableReplicas": n}}, sub="status")
    await cluster.wait_for("Ready", lambda: condition(cluster, "rank", "Ready", SERVICES).get("status") == "True")
    assert status(cluster, "rank", SERVICES)["readyReplicas"] == 2
    # A running ranker pod (as the StatefulSet controller and kubelet would make it): the hit rate appears.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "rank-ranker-0", "namespace": "default",
                                                           "labels": {names.LABEL_SERVICE: "rank",
                                                                      names.LABEL_COMPONENT: "ranker"}},
           "spec": {"containers": [{"name": "ranker", "image": "grstack:test"}]}}
    await create(cluster, pod)
    await cluster.patch("v1/pods", "rank-ranker-0", {"status": {"phase": "Running", "podIP": "127.0.0.1"}}, sub="status")
    await cluster.wait_for("hit rate", lambda: status(cluster, "rank", SERVICES).get("cacheHitRate") == 0.8)
    # The rate is windowed (10 s here): once the window has moved past, only the new lookups count. That value
    # shows from 10 s after the first sample with these counters until 10 s after the first sample with the new
    # ones, so the counters change 3 resync periods (1 s) after the 0.8 was seen: otherwise, on a fast machine,
    # no reconcile pass may fall in that interval and the value is never written.
    await asyncio.sleep(3.0)
    counters.update({"device_hits": 7, "dram_hits": 2, "misses": 12})  # 1 hit, 10 misses since
    await cluster.wait_for("windowed hit rate",
                           lambda: status(cluster, "rank", SERVICES).get("cacheHitRate") == 0.0909)
    await runner.cleanup()
    await cluster.patch(SERVICES, "rank", {"spec": {"replicas": 3}}, sub="scale")  # e.g. kubectl scale / HPA
    await cluster.wait_for("scaled", lambda: cluster.get("apps/v1/statefulsets", "rank-ranker")["spec"]["replicas"]
                           == 3)
    await cluster.wait_for("Ready False", lambda: condition(cluster, "rank", "Ready", SERVICES).get("status")
                           == "False")
    await create(cluster, ranking_service("broken", etcd={"managed": True, "endpoints": ["http://e:2379"]}))
    await cluster.wait_for("InvalidSpec", lambda: condition(cluster, "broken", "Ready", SERVICES).get("reason")
                           == "InvalidSpec")
    assert cluster.get("apps/v1/statefulsets", "broken-ranker") is None

"""Thin kopf handlers: observe, call the pure reconcilers, apply their plans.

One daemon per custom resource runs the reconcile loop (wakes up on events of its pods/children, on spec
changes, and every ``resync_seconds``); it re-reads the resource and its pods from the API server on each
pass, so decisions never rest on a stale cache. create/update/resume handlers validate and wake the
daemon; an invalid spec raises ``kopf.PermanentError`` (not retried) after the daemon has written the
``InvalidSpec`` condition. Children carry ownerReferences, so Kubernetes' garbage collector removes them
with their owner; the delete handler only forgets the resource. Every write is idempotent: create tolerates
409, delete tolerates 404, patches are JSON merge patches of the desired state.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from grstack.operator import names, serving, training
from grstack.operator.kube import ApiError, KubeClient
from grstack.operator.metrics import OperatorMetrics

log = logging.getLogger("grstack.operator")


@dataclass
class OperatorConfig:
    server: str | None = None  # talk to this API server without credentials (tests, kubectl proxy)
    resync_seconds: float = 10.0
    error_backoff_seconds: float = 5.0


@dataclass
class Runtime:
    config: OperatorConfig
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    client: KubeClient | None = None
    wakeups: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    hit_rates: dict[tuple[str, str], serving.HitRateWindow] = field(default_factory=dict)

    def wake(self, key: tuple[str, str, str]) -> None:
        event = self.wakeups.get(key)
        if event is not None:
            event.set()

    async def sleep(self, key: tuple[str, str, str], seconds: float) -> None:
        event = self.wakeups.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.05, seconds))
        event.clear()

    def kube(self) -> KubeClient:
        if self.client is None:
            raise kopf.TemporaryError("not logged in yet", delay=1)
        return self.client


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def plain(body: Any) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def covers(desired: Any, live: Any) -> bool:
    """Whether the live object already has every desired field (the API server adds defaults of its own)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(covers(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(desired) == len(live) and all(map(covers, desired, live))
    return desired == live or (desired is not None and live is not None and str(desired) == str(live))


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch turning ``old`` status into ``new`` (removed keys become null); None when equal."""
    if old == new:
        return None
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


async def ensure(client: KubeClient, obj: dict[str, Any], *, update: bool) -> dict[str, Any]:
    """Create ``obj`` if missing; with ``update``, merge-patch it when the live object differs."""
    meta = obj["metadata"]
    live = await client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if live is None:
        try:
            return await client.create(obj)
        except ApiError as exc:
            if exc.status != 409:
                raise
            live = await client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) or {}
    if update and not covers(obj, live):
        return await client.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], obj)
    return live


def post_events(body: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
    for type_, reason, message in events:
        try:
            kopf.event(body, type=type_, reason=reason, message=message[:1000])
        except LookupError:  # outside kopf's context (direct calls in tests)
            log.info("%s %s: %s", type_, reason, message)


# -------------------------------------------------------------------------------------------- training


async def reconcile_training_once(rt: Runtime, namespace: str, name: str) -> float | None:
    """One pass: read, plan, apply. Returns when to come back (None = the regular resync)."""
    client = rt.kube()
    key = (namespace, name)
    started = time.perf_counter()
    job = await client.get(names.API_VERSION, names.TRAINING_KIND, namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        rt.metrics.job_state(key, None)
        return None
    uid = job["metadata"].get("uid")
    pods = [p for p in await client.list("v1", "Pod", namespace, {names.LABEL_JOB: name}) if owned_by(p, uid)]
    plan = training.reconcile_training(job, pods, now())

    patch = status_patch(job.get("status") or {}, plan.status)
    if patch is not None:
        await client.patch(names.API_VERSION, names.TRAINING_KIND, namespace, name, {"status": patch},
                           subresource="status")
    post_events(job, plan.events)
    if plan.status.get("restarts", 0) > (job.get("status") or {}).get("restarts", 0):
        rt.metrics.restarts.inc()
    for child in plan.children:
        await ensure(client, child, update=False)
    for pod_name in plan.delete_pods:
        if await client.delete("v1", "Pod", namespace, pod_name):
            rt.metrics.pods_deleted.inc()
    for pod in plan.create_pods:
        try:
            await client.create(pod)
            rt.metrics.pods_created.inc()
        except ApiError as exc:
            if exc.status != 409:
                raise
    if plan.delete_job:
        log.info("deleting %s/%s: ttlSecondsAfterFinished has passed", namespace, name)
        await client.delete(names.API_VERSION, names.TRAINING_KIND, namespace, name)
    rt.metrics.job_state(key, plan.status.get("state"))
    rt.metrics.reconcile_seconds.labels("GRTrainingJob").observe(time.perf_counter() - started)
    return plan.requeue_after


# --------------------------------------------------------------------------------------------- serving

_CHILD_KINDS = (("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
                ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"))


async def reconcile_serving_once(rt: Runtime, namespace: str, name: str) -> float | None:
    client = rt.kube()
    key = (namespace, name)
    started = time.perf_counter()
    svc = await client.get(names.API_VERSION, names.SERVING_KIND, namespace, name)
    if svc is None or svc["metadata"].get("deletionTimestamp"):
        rt.metrics.service_ready(key, None)
        return None
    uid = svc["metadata"].get("uid")
    observed: dict[tuple[str, str], dict[str, Any]] = {}
    for api_version, kind in _CHILD_KINDS:
        for obj in await client.list(api_version, kind, namespace, {names.LABEL_SERVICE: name}):
            if owned_by(obj, uid):
                observed[(kind, obj["metadata"]["name"])] = obj
    pods = await client.list("v1", "Pod", namespace, {names.LABEL_SERVICE: name})
    stats = await fetch_stats(serving.stats_targets(svc, pods))
    window = rt.hit_rates.setdefault(key, serving.HitRateWindow())
    plan = serving.reconcile_serving(svc, observed, stats, now(), window)

    for child in plan.children:
        await ensure(client, child, update=True)
    for api_version, kind, child_name in plan.delete:
        await client.delete(api_version, kind, namespace, child_name)
    patch = status_patch(svc.get("status") or {}, plan.status)
    if patch is not None:
        await client.patch(names.API_VERSION, names.SERVING_KIND, namespace, name, {"status": patch},
                           subresource="status")
    post_events(svc, plan.events)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in plan.status.get("conditions", []))
    rt.metrics.service_ready(key, ready)
    rt.metrics.reconcile_seconds.labels("GRRankingService").observe(time.perf_counter() - started)
    return None


async def fetch_stats(urls: list[str], timeout: float = 1.0) -> list[dict[str, Any]]:
    """The rankers' cache counters; an unreachable or slow ranker is skipped (the rate is best effort)."""
    if not urls:
        return []

    async def one(http: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
        try:
            async with http.get(url) as resp:
                return await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        answers = await asyncio.gather(*(one(http, u) for u in urls))
    return [{**a, "_target": u} for u, a in zip(urls, answers, strict=True) if isinstance(a, dict)]


# ---------------------------------------------------------------------------------------------- registry


async def _loop(rt: Runtime, kind: str, namespace: str, name: str, stopped: Any,
                once: Callable[[Runtime, str, str], Awaitable[float | None]]) -> None:
    key = (kind, namespace, name)
    rt.wakeups.setdefault(key, asyncio.Event())
    try:
        while not stopped:
            try:
                wait = await once(rt, namespace, name)
                rt.metrics.reconciles.labels(kind, "ok").inc()
            except (TimeoutError, ApiError, OSError, kopf.TemporaryError) as exc:
                rt.metrics.reconciles.labels(kind, "error").inc()
                log.warning("reconcile of %s %s/%s failed, retrying: %s", kind, namespace, name, exc)
                wait = rt.config.error_backoff_seconds
            await rt.sleep(key, rt.config.resync_seconds if wait is None else min(wait, rt.config.resync_seconds))
    finally:
        rt.wakeups.pop(key, None)


def build_registry(config: OperatorConfig | None = None) -> tuple[kopf.OperatorRegistry, Runtime]:
    """A fresh registry with every handler bound to one Runtime (tests build several)."""
    rt = Runtime(config or OperatorConfig())
    registry = kopf.OperatorRegistry()
    G, V = names.GROUP, names.VERSION

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = f"{names.GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration")
        settings.posting.level = logging.WARNING  # kopf's own chatter stays in the log, not in Events

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        if rt.config.server:
            info = kopf.ConnectionInfo(server=rt.config.server, default_namespace="default")
        else:
            info = kopf.login_via_client(**kwargs) or kopf.login_with_service_account(**kwargs) \
                or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            rt.client = KubeClient.from_connection(info)
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if rt.client is not None:
            await rt.client.close()

    @kopf.on.probe(id="resources", registry=registry)
    def probe(**_: Any) -> dict[str, int]:
        return {"watched": len(rt.wakeups)}

    # Training jobs.
    @kopf.on.create(G, V, names.TRAINING_PLURAL, registry=registry)
    @kopf.on.update(G, V, names.TRAINING_PLURAL, field="spec", registry=registry)
    @kopf.on.resume(G, V, names.TRAINING_PLURAL, registry=registry)
    def training_changed(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
        rt.wake(("GRTrainingJob", namespace, name))
        try:
            training.parse_spec(plain(body))
        except training.InvalidSpec as exc:
            raise kopf.PermanentError(f"invalid spec: {exc}") from None

    @kopf.daemon(G, V, names.TRAINING_PLURAL, registry=registry, cancellation_timeout=1.0)
    async def training_daemon(namespace: str, name: str, stopped: Any, **_: Any) -> None:
        await _loop(rt, "GRTrainingJob", namespace, name, stopped, reconcile_training_once)

    @kopf.on.delete(G, V, names.TRAINING_PLURAL, optional=True, registry=registry)
    def training_deleted(namespace: str, name: str, **_: Any) -> None:
        rt.metrics.job_state((namespace, name), None)

    @kopf.on.event("pods", labels={names.LABEL_JOB: kopf.PRESENT}, registry=registry)
    def worker_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
        rt.wake(("GRTrainingJob", namespace, labels[names.LABEL_JOB]))

    # Ranking services.
    @kopf.on.create(G, V, names.SERVING_PLURAL, registry=registry)
    @kopf.on.update(G, V, names.SERVING_PLURAL, field="spec", registry=registry)
    @kopf.on.resume(G, V, names.SERVING_PLURAL, registry=registry)
    def service_changed(body: kopf.Body, namespace: str, name: str, **_: Any) -> None:
        rt.wake(("GRRankingService", namespace, name))
        plan = serving.reconcile_serving(plain(body), {}, [], now())  # validation only
        ready = next((c for c in plan.status.get("conditions", []) if c.get("type") == "Ready"), {})
        if ready.get("reason") == "InvalidSpec":
            raise kopf.PermanentError(f"invalid spec: {ready.get('message')}")

    @kopf.daemon(G, V, names.SERVING_PLURAL, registry=registry, cancellation_timeout=1.0)
    async def service_daemon(namespace: str, name: str, stopped: Any, **_: Any) -> None:
        await _loop(rt, "GRRankingService", namespace, name, stopped, reconcile_serving_once)

    @kopf.on.delete(G, V, names.SERVING_PLURAL, optional=True, registry=registry)
    def service_deleted(namespace: str, name: str, **_: Any) -> None:
        rt.metrics.service_ready((namespace, name), None)
        rt.hit_rates.pop((namespace, name), None)

    for resource in ("statefulsets", "deployments"):
        @kopf.on.event(resource, labels={names.LABEL_SERVICE: kopf.PRESENT}, registry=registry,
                       id=f"serving-{resource}")
        def serving_child_event(labels: dict[str, str], namespace: str, **_: Any) -> None:
            rt.wake(("GRRankingService", namespace, labels[names.LABEL_SERVICE]))

    return registry, rt

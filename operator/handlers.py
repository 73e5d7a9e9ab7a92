"""Thin kopf handlers: observe, call the pure reconcilers, apply their plans.

One daemon per custom resource runs the reconcile loop (wakes up on events of its pods/children, on spec
changes, and every ``resync_seconds``); it re-reads the resource and its pods from the API server on each
pass, so decisions never rest on a stale cache. create/update/resume handlers validate and wake the
daemon; an invalid spec raises ``kopf.PermanentError`` (not retried) after the daemon has written the
``InvalidSpec`` condition. Children carry ownerReferences, so Kubernetes' garbage collector removes them
with their owner; the delete handler only forgets the resource. Every write is idempotent: create tolerates
409, delete tolerates 404, patches are JSON merge patches of the desired state. A create or patch the API
server refuses otherwise is no reason to fail the pass silently: it is written into the resource's status
(``refusals``: condition ReplicaFailure, a Warning Event, a backoff held in ``status.nextRetryTime``), and the
status is written after the children and pods, so its times describe writes that happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import kopf

from grstack.operator import kueue, names, objects, refusals, serving, training
from grstack.operator.kube import ApiError, KubeClient
from grstack.operator.metrics import OperatorMetrics

log = logging.getLogger("grstack.operator")


@dataclass
class OperatorConfig:
    server: str | None = None  # talk to this API server without credentials (tests, kubectl proxy)
    resync_seconds: float = 10.0
    # After a failed pass: base * 2**(failures - 1), capped, with +-20% jitter; reset by a good pass.
    error_backoff_seconds: float = 1.0
    error_backoff_max_seconds: float = 300.0
    # Leader election through kopf peering: the name of the (Cluster)KopfPeering object; None = standalone.
    peering: str | None = None
    priority: int = 0  # this replica's peering priority (the highest live one leads)
    peering_lifetime_s: int = 60  # a peer silent this long counts as dead (how soon a standby takes over)
    namespaced_peering: bool = False  # KopfPeering in the watched namespaces instead of ClusterKopfPeering
    peering_namespace: str | None = None
    readiness_port: int = 0  # /readyz (CRDs found; leader or standby in the body); 0 = off


TERMINAL_STATES = frozenset({"Succeeded", "Failed"})


def error_backoff(config: OperatorConfig, failures: int, jitter: float = 0.0) -> float:
    """Seconds to wait after ``failures`` consecutive failed passes; ``jitter`` in [-1, 1] scales +-20%."""
    base = config.error_backoff_seconds * 2 ** min(max(failures - 1, 0), 30)
    return min(base, config.error_backoff_max_seconds) * (1 + 0.2 * jitter)


@dataclass
class Runtime:
    config: OperatorConfig
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    client: KubeClient | None = None
    wakeups: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    hit_rates: dict[tuple[str, str], serving.HitRateWindow] = field(default_factory=dict)
    identity: str = field(default_factory=lambda: os.environ.get("POD_ID") or socket.gethostname())
    readiness_runner: Any = None

    def wake(self, key: tuple[str, str, str]) -> None:
        event = self.wakeups.get(key)
        if event is not None:
            event.set()

    async def sleep(self, key: tuple[str, str, str], seconds: float | None) -> None:
        """Until woken, or ``seconds`` (None: until woken)."""
        event = self.wakeups.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=None if seconds is None else max(0.05, seconds))
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


covers = objects.covers  # live objects hold canonical quantities ("500m" for "0.5"): compared by value


def status_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch turning ``old`` status into ``new`` (removed keys become null); None when equal."""
    if old == new:
        return None
    patch: dict[str, Any] = {k: v for k, v in new.items() if old.get(k) != v}
    patch.update({k: None for k in old if k not in new})
    return patch


class Refused(ApiError):
    """The API server refused a write of a child (a 4xx/5xx answer other than 409 to a create or patch)."""

    def __init__(self, operation: str, obj: dict[str, Any], error: ApiError) -> None:
        super().__init__(error.status, error.reason, error.message)
        self.refusal = refusals.Refusal(operation=operation, kind=str(obj.get("kind")),
                                        name=str(obj.get("metadata", {}).get("name")), code=error.status,
                                        reason=error.reason, message=error.message)


async def ensure(client: KubeClient, obj: dict[str, Any], *, update: bool) -> dict[str, Any]:
    """Create ``obj`` if missing; with ``update``, merge-patch it when the live object differs. A refused
    create or patch raises Refused."""
    meta = obj["metadata"]
    live = await client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
    if live is None:
        try:
            return await client.create(obj)
        except ApiError as exc:
            if exc.status != 409:
                raise Refused("create", obj, exc) from exc
            live = await client.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]) or {}
    if update and not covers(obj, live):
        try:
            return await client.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], obj)
        except ApiError as exc:
            raise Refused("patch", obj, exc) from exc
    return live


def _namespaced(namespace: str | None) -> str:
    """kopf types a handler's ``namespace`` as optional (cluster-scoped kinds have none); every kind watched
    here is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def post_events(body: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
    for type_, reason, message in events:
        try:
            # kopf reads only apiVersion, kind and metadata, which a plain dict carries as well as a Body
            kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message[:1000])
        except LookupError:  # outside kopf's context (direct calls in tests)
            log.info("%s %s: %s", type_, reason, message)


# -------------------------------------------------------------------------------------------- training


def holding(status: dict[str, Any], generation: int | None, now_: dt.datetime) -> float | None:
    """Seconds left of the backoff after a refused write (status.nextRetryTime), or None: retry now. A new
    generation (the user changed the spec, maybe to fix what was refused) retries at once."""
    due = objects.parse_time(status.get("nextRetryTime"))
    cond = objects.condition(status.get("conditions") or [], refusals.CONDITION) or {}
    if due is None or due <= now_ or cond.get("observedGeneration") != generation:
        return None
    return (due - now_).total_seconds()


def surface(rt: Runtime, status: dict[str, Any], events: list[tuple[str, str, str]],
            refused: refusals.Refusal | None, wait: float | None, generation: int | None, where: str) -> float | None:
    """After the writes of a pass: a refusal goes into ``status`` and ``events`` with the next backoff (which
    is returned); a pass whose writes all went through clears the backoff. ``wait``: a backoff still held."""
    if refused is not None:
        wait = error_backoff(rt.config, refusals.retries(status) + 1, random.uniform(-1, 1))
        events += refusals.record(status, refused, wait, now(), generation)
        log.warning("%s: %s", where, refused.describe())
    elif wait is None:
        events += refusals.clear(status, now(), generation)
    return wait


async def reconcile_training_once(rt: Runtime, namespace: str, name: str) -> float | None:
    """One pass: read, plan, write the children and pods, then the status (whose times and failures describe
    the writes just made). Returns when to come back (None = the regular resync)."""
    client = rt.kube()
    key = (namespace, name)
    started = time.perf_counter()
    job = await client.get(names.API_VERSION, names.TRAINING_KIND, namespace, name)
    if job is None or job["metadata"].get("deletionTimestamp"):
        rt.metrics.job_state(key, None)
        return None
    uid = job["metadata"].get("uid")
    generation = job["metadata"].get("generation")
    pods = [p for p in await client.list("v1", "Pod", namespace, {names.LABEL_JOB: name}) if owned_by(p, uid)]
    view = await kueue.observe(client, job)  # None: the job names no Kueue queue
    plan = training.reconcile_training(job, pods, now(), kueue_view=view)
    wait = holding(plan.status, generation, now())

    refused: refusals.Refusal | None = None
    if wait is None:
        for child in plan.children:  # kept up to date: a spec change reaches the ConfigMap and the Role
            try:
                await ensure(client, child, update=True)
            except Refused as exc:
                if child["kind"] == "PodGroup" and exc.status in (403, 404):
                    log.warning("%s/%s: cannot create the %s PodGroup (is the gang scheduler installed and the "
                                "operator allowed to manage podgroups?): %s", namespace, name, child["apiVersion"],
                                exc)
                    continue
                refused = refused or exc.refusal
    for pod_name in plan.delete_pods:
        if await client.delete("v1", "Pod", namespace, pod_name):
            rt.metrics.pods_deleted.inc()
    if plan.kueue is not None and (wait is None or plan.kueue.create is None):
        failed = await kueue.apply(client, namespace, plan.kueue)
        if failed is not None:
            refused = refused or Refused(*failed).refusal
    created = 0
    if wait is None and refused is None:  # the pods need their ConfigMap, Service and account
        for pod in plan.create_pods:
            try:
                await client.create(pod)
            except ApiError as exc:
                if exc.status == 409:
                    continue
                refused = Refused("create", pod, exc).refusal
                break  # the rest of the gang would meet the same answer; none waits on a partial gang
            created += 1
            rt.metrics.pods_created.inc()
    training.record_created(plan, created, now())
    wait = surface(rt, plan.status, plan.events, refused, wait, generation, f"{namespace}/{name}")
    if wait is not None:
        plan.requeue_after = wait if plan.requeue_after is None else min(plan.requeue_after, wait)

    patch = status_patch(job.get("status") or {}, plan.status)
    if patch is not None:
        await client.patch(names.API_VERSION, names.TRAINING_KIND, namespace, name, {"status": patch},
                           subresource="status")
    post_events(job, plan.events)
    if training.attempt_of(plan.status) > training.attempt_of(job.get("status") or {}):
        rt.metrics.restarts.inc()
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
    generation = svc["metadata"].get("generation")
    wait = holding(plan.status, generation, now())

    refused: refusals.Refusal | None = None
    if wait is None:
        for child in plan.children:
            try:
                await ensure(client, child, update=True)
            except Refused as exc:
                refused = refused or exc.refusal
    for api_version, kind, child_name in plan.delete:
        await client.delete(api_version, kind, namespace, child_name)
    wait = surface(rt, plan.status, plan.events, refused, wait, generation, f"{namespace}/{name}")
    patch = status_patch(svc.get("status") or {}, plan.status)
    if patch is not None:
        await client.patch(names.API_VERSION, names.SERVING_KIND, namespace, name, {"status": patch},
                           subresource="status")
    post_events(svc, plan.events)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in plan.status.get("conditions", []))
    rt.metrics.service_ready(key, ready)
    rt.metrics.reconcile_seconds.labels("GRRankingService").observe(time.perf_counter() - started)
    return wait


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

    # ssl=False: an https:// ranker (spec.tls) is polled without verifying its certificate: the operator holds
    # no Secrets (no CA), sends nothing and reads only cache counters.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout),
                                     connector=aiohttp.TCPConnector(ssl=False)) as http:
        answers = await asyncio.gather(*(one(http, u) for u in urls))
    return [{**a, "_target": u} for u, a in zip(urls, answers, strict=True) if isinstance(a, dict)]


# ---------------------------------------------------------------------------------------------- registry


def next_wait(rt: Runtime, kind: str, namespace: str, name: str, wait: float | None) -> float | None:
    """How long the loop sleeps after a good pass: a finished training job sleeps until an event wakes it
    (a spec change, one of its pods) unless it asked to come back (TTL); None = no timeout."""
    if wait is None and kind == "GRTrainingJob" and rt.metrics.job_state_of((namespace, name)) in TERMINAL_STATES:
        return None
    return rt.config.resync_seconds if wait is None else min(wait, rt.config.resync_seconds)


async def _loop(rt: Runtime, kind: str, namespace: str, name: str, stopped: Any,
                once: Callable[[Runtime, str, str], Awaitable[float | None]]) -> None:
    key = (kind, namespace, name)
    rt.wakeups.setdefault(key, asyncio.Event())
    failures = 0
    try:
        while not stopped:
            try:
                wait = next_wait(rt, kind, namespace, name, await once(rt, namespace, name))
                rt.metrics.reconciles.labels(kind, "ok").inc()
                failures = 0
            except (TimeoutError, ApiError, OSError, kopf.TemporaryError) as exc:
                rt.metrics.reconciles.labels(kind, "error").inc()
                failures += 1
                wait = error_backoff(rt.config, failures, random.uniform(-1, 1))
                log.warning("reconcile of %s %s/%s failed (%d in a row), retrying in %.1f s: %s", kind, namespace,
                            name, failures, wait, exc)
            await rt.sleep(key, wait)
    finally:
        rt.wakeups.pop(key, None)


# ------------------------------------------------------------------------------------------- readiness


async def crds_found(client: KubeClient) -> bool:
    try:
        payload = await client.request("GET", f"/apis/{names.GROUP}/{names.VERSION}")
    except (ApiError, OSError, TimeoutError):
        return False
    found = {r.get("name") for r in payload.get("resources") or []}
    return {names.TRAINING_PLURAL, names.SERVING_PLURAL} <= found


def leads(peering_status: dict[str, Any], identity: str, now_: dt.datetime) -> bool:
    """Whether ``identity`` leads in a kopf peering object's status: it is there, alive, and no other live
    peer has its priority or a higher one (kopf pauses an operator in both cases)."""
    def alive(info: dict[str, Any]) -> bool:
        seen = info.get("lastseen")
        try:
            last = dt.datetime.fromisoformat(str(seen).replace("Z", "+00:00"))
        except ValueError:
            return False
        if last.tzinfo is None:
            last = last.replace(tzinfo=dt.UTC)
        return (now_ - last).total_seconds() <= float(info.get("lifetime") or 60)

    mine = peering_status.get(identity)
    if not isinstance(mine, dict) or not alive(mine):
        return False
    prio = int(mine.get("priority") or 0)
    return not any(isinstance(info, dict) and alive(info) and int(info.get("priority") or 0) >= prio
                   for peer, info in peering_status.items() if peer != identity)


async def readiness(rt: Runtime) -> tuple[bool, dict[str, Any]]:
    """Ready once logged in and the CRDs are served; with leader election the body says whether this
    replica leads (a standby stays ready: it takes over when the leader's peering lease lapses, and an
    unready standby would stall rolling updates)."""
    if rt.client is None:
        return False, {"reason": "not logged in"}
    if not await crds_found(rt.client):
        return False, {"reason": f"the {names.GROUP} CRDs are not installed"}
    body: dict[str, Any] = {"crds": True}
    cfg = rt.config
    if cfg.peering:
        path = (f"/apis/kopf.dev/v1/namespaces/{cfg.peering_namespace}/kopfpeerings/{cfg.peering}"
                if cfg.namespaced_peering else f"/apis/kopf.dev/v1/clusterkopfpeerings/{cfg.peering}")
        try:
            peering = await rt.client.request("GET", path)
        except (ApiError, OSError, TimeoutError) as exc:
            return False, {"reason": f"peering object {cfg.peering}: {exc}"}
        leader = leads(peering.get("status") or {}, rt.identity, now())
        rt.metrics.leader.set(1 if leader else 0)
        body.update(leader=leader, identity=rt.identity, priority=cfg.priority)
    return True, body


async def start_readiness_server(rt: Runtime, port: int, host: str = "0.0.0.0") -> aiohttp.web.AppRunner:
    from aiohttp import web

    async def readyz(_: web.Request) -> web.Response:
        ok, body = await readiness(rt)
        return web.json_response({"ready": ok, **body}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


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
        # Server-side label selectors: the API server sends only our children, not every pod/StatefulSet/
        # Deployment in the watched namespaces (the handlers' labels= filters stay as a second check).
        settings.watching.label_selectors["v1", "pods"] = names.LABEL_JOB
        settings.watching.label_selectors["apps", "v1", "statefulsets"] = names.LABEL_SERVICE
        settings.watching.label_selectors["apps", "v1", "deployments"] = names.LABEL_SERVICE
        if rt.config.peering:
            settings.peering.name = rt.config.peering
            settings.peering.priority = rt.config.priority
            settings.peering.lifetime = rt.config.peering_lifetime_s
            settings.peering.mandatory = True
            settings.peering.standalone = False
            settings.peering.clusterwide = not rt.config.namespaced_peering

    @kopf.on.startup(registry=registry)
    async def readiness_server(**_: Any) -> None:
        if rt.config.readiness_port:
            rt.readiness_runner = await start_readiness_server(rt, rt.config.readiness_port)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info: kopf.ConnectionInfo | None
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
        if rt.readiness_runner is not None:
            await rt.readiness_runner.cleanup()
        if rt.client is not None:
            await rt.client.close()

    @kopf.on.probe(id="resources", registry=registry)
    def probe(**_: Any) -> dict[str, int]:
        return {"watched": len(rt.wakeups)}

    # Training jobs.
    @kopf.on.create(G, V, names.TRAINING_PLURAL, registry=registry)
    @kopf.on.update(G, V, names.TRAINING_PLURAL, field="spec", registry=registry)
    @kopf.on.resume(G, V, names.TRAINING_PLURAL, registry=registry)
    def training_changed(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
        rt.wake(("GRTrainingJob", _namespaced(namespace), name))
        try:
            training.parse_spec(plain(body))
        except training.InvalidSpec as exc:
            raise kopf.PermanentError(f"invalid spec: {exc}") from None

    @kopf.daemon(G, V, names.TRAINING_PLURAL, registry=registry, cancellation_timeout=1.0)
    async def training_daemon(namespace: str | None, name: str, stopped: Any, **_: Any) -> None:
        await _loop(rt, "GRTrainingJob", _namespaced(namespace), name, stopped, reconcile_training_once)

    @kopf.on.delete(G, V, names.TRAINING_PLURAL, optional=True, registry=registry)
    def training_deleted(namespace: str | None, name: str, **_: Any) -> None:
        rt.metrics.job_state((_namespaced(namespace), name), None)

    @kopf.on.event(kueue.GROUP, kueue.API_VERSION.rpartition("/")[2], kueue.WORKLOAD_PLURAL,
                   labels={names.LABEL_JOB: kopf.PRESENT}, registry=registry)
    def workload_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
        """Kueue admitted or evicted a job's Workload (watched once Kueue's CRDs exist)."""
        rt.wake(("GRTrainingJob", _namespaced(namespace), labels[names.LABEL_JOB]))

    @kopf.on.event("pods", labels={names.LABEL_JOB: kopf.PRESENT}, registry=registry)
    def worker_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
        rt.wake(("GRTrainingJob", _namespaced(namespace), labels[names.LABEL_JOB]))

    # Ranking services.
    @kopf.on.create(G, V, names.SERVING_PLURAL, registry=registry)
    @kopf.on.update(G, V, names.SERVING_PLURAL, field="spec", registry=registry)
    @kopf.on.resume(G, V, names.SERVING_PLURAL, registry=registry)
    def service_changed(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
        rt.wake(("GRRankingService", _namespaced(namespace), name))
        plan = serving.reconcile_serving(plain(body), {}, [], now())  # validation only
        ready: dict[str, Any] = next(
            (c for c in plan.status.get("conditions", []) if c.get("type") == "Ready"), {})
        if ready.get("reason") == "InvalidSpec":
            raise kopf.PermanentError(f"invalid spec: {ready.get('message')}")

    @kopf.daemon(G, V, names.SERVING_PLURAL, registry=registry, cancellation_timeout=1.0)
    async def service_daemon(namespace: str | None, name: str, stopped: Any, **_: Any) -> None:
        await _loop(rt, "GRRankingService", _namespaced(namespace), name, stopped, reconcile_serving_once)

    @kopf.on.delete(G, V, names.SERVING_PLURAL, optional=True, registry=registry)
    def service_deleted(namespace: str | None, name: str, **_: Any) -> None:
        key = (_namespaced(namespace), name)
        rt.metrics.service_ready(key, None)
        rt.hit_rates.pop(key, None)

    for resource in ("statefulsets", "deployments"):
        @kopf.on.event(resource, labels={names.LABEL_SERVICE: kopf.PRESENT}, registry=registry,
                       id=f"serving-{resource}")
        def serving_child_event(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
            rt.wake(("GRRankingService", _namespaced(namespace), labels[names.LABEL_SERVICE]))

    return registry, rt

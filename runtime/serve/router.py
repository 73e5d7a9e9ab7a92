"""The stateless router: the sequence-aware trigger for prefill signals and affinity routing for ranks.

Routing of a user: the placement recorded in the store (if its replica is up), else consistent hashing
with bounded load over the replicas that are up. The router keeps a local view of replicas and
placements fed by the store's watch, so no store round trip sits on the request path; when the store
(etcd) is unreachable the view keeps its last state, new placements are kept locally, and routing goes on
over the hash ring. A rank whose replica fails (connection error, timeout, 5xx, a full queue, a rank the
ranker predicts would finish late) is retried on the next replica in ring order, where it is a cache miss
and runs full inference.

Overload and deadlines: every rank gets a deadline from its budget (``rank_budget_ms``, or less if the
client sends ``X-Grstack-Deadline-Ms``); the remaining budget travels to the ranker in the same header
and bounds each attempt, and a rank past its deadline is answered 504, never retried. Retries are capped
by a retry budget (``retry_budget_ratio`` of the requests over ``retry_budget_window_s``, plus
``retry_budget_min``), so retries cannot multiply the load of an overloaded service. A replica that
cannot be connected to is marked down until its ``/readyz`` answers; a slow or failing one is ejected by
outlier detection (``outlier_consecutive_failures`` consecutive 5xx/timeouts, or a median latency
``outlier_latency_factor`` times the other replicas', looked for among ``outlier_latency_min_hosts`` or more),
for ``outlier_base_ejection_s`` times the number of its recent ejections (at most ``outlier_max_ejection_s``;
the count drops by one per base ejection time healthy), never more than ``outlier_max_ejected_fraction`` of
the replicas at once — one timeout ejects nothing.

Load reports: every ``load_poll_interval_s`` the router reads each up ranker's ``/v1/stats`` (queue depth,
prefill backlog, cumulative compute ms, cache residency and capacity). The trigger turns them into per-ranker
budgets that hold across routers (see trigger.py); the routing view takes each replica's load as the longer
of this router's in-flight rank requests and the ranker's reported rank queue (prefills, background work, are
left out). A placed user whose replica is over its load cap (``overload_min_load``, ``load_factor`` x the
mean) is routed where the bounded-load ring says (``X-Grstack-Route: moved``), and a prefill whose replica's
budget is spent is admitted on the ring's next choice, placed there through the same placement path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import socket
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grstack.runtime.serve.gc_pauses import GcPauseMetric
from grstack.runtime.serve.http import (
    DEADLINE_HEADER,
    MAX_BODY,
    RequestError,
    error_response,
    json_errors,
    metrics_handler,
    model_response,
    openapi_document,
    openapi_handler,
    parse_body,
    parse_deadline_ms,
    route_template,
    status_class,
)
from grstack.runtime.serve.placement import (
    Event,
    MemoryPlacementStore,
    Placement,
    PlacementStore,
    Replica,
    StoreUnavailable,
)
from grstack.runtime.serve.prefix import context_key, prefix_hash, truncate_prefix
from grstack.runtime.serve.ring import HashRing
from grstack.runtime.serve.schemas import (
    MAX_BODY_BYTES,
    Health,
    PrefillRequest,
    PrefillResponse,
    Profile,
    RankRequest,
    RankResponse,
    RouterPrefillResponse,
)
from grstack.runtime.serve.security import ClientSecurity, ServerSecurity, guard
from grstack.runtime.serve.trigger import LatencyModel, SequenceAwareTrigger, TriggerConfig

log = logging.getLogger(__name__)
LOCAL = -1  # revision of a placement known only to this router (written while the store was down)
HOME = 0  # revision of a placement on the user's ring home: derived, never stored (exceptions-only)


@dataclass
class RouterConfig:
    rankers: tuple[str, ...] = ()  # static replicas (embedded mode); empty: discover them in the store
    # "HOST:PORT" of a headless Service: its A/AAAA records (the ready rankers) are the replicas, re-resolved
    # every dns_interval_s, so the ranker count is not baked into the router's arguments.
    rankers_dns: str | None = None
    dns_interval_s: float = 5.0
    # Admitted-prefix footprint per up replica (the trigger's cache budget follows the ranker count); None
    # keeps trigger.cache_budget_bytes as given.
    cache_budget_per_replica_bytes: int | None = None
    relay: bool = True  # False: prefill signals are ignored (the baseline)
    # False: every rank and prefill goes to a uniformly random up replica, placements are ignored (an ablation
    # that measures what cache affinity is worth; a prefix is then found only by chance)
    affinity: bool = True
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    prefill_budget_per_replica_ms: float = 500.0  # predicted pre-infer ms per replica per second
    # -- rankers' load reports (GET /v1/stats): per-ranker trigger budgets, users moved off overloaded replicas
    # GET /v1/stats of every up ranker this often (0: never; the trigger's budgets then stay router-wide)
    load_poll_interval_s: float = 1.0
    # a replica is over its load cap when its requests (this router's in flight, or the queue the ranker
    # reports if longer) exceed load_factor x the mean over up replicas and number at least this many: a
    # placed user then goes where the bounded-load ring says (a cache hit on a short queue beats a miss elsewhere)
    overload_min_load: int = 4
    rank_timeout_s: float = 2.0
    prefill_timeout_s: float = 120.0
    max_attempts: int = 3
    load_factor: float = 1.25
    health_interval_s: float = 1.0
    startup_timeout_s: float = 60.0
    max_body_bytes: int = MAX_BODY_BYTES
    # deadline budget of a rank (ms; None: rank_timeout_s); a client's X-Grstack-Deadline-Ms can only shorten it
    rank_budget_ms: float | None = None
    retry_budget_ratio: float = 0.1  # retries allowed per request over the window
    retry_budget_min: int = 3  # retries allowed per window regardless of traffic
    retry_budget_window_s: float = 10.0
    outlier_consecutive_failures: int = 5  # consecutive 5xx/timeouts that eject a replica
    outlier_base_ejection_s: float = 5.0  # ejection time = base x ejections so far (capped)
    outlier_max_ejection_s: float = 60.0
    outlier_max_ejected_fraction: float = 0.5  # at most this share of replicas ejected (always at least one)
    outlier_latency_factor: float | None = 5.0  # median latency this many times the others' ejects; None: off
    outlier_latency_min_samples: int = 20
    outlier_latency_floor_ms: float = 20.0  # a replica faster than this is never a latency outlier
    # latency outliers are looked for only among at least this many replicas with enough samples (Envoy's
    # success_rate_minimum_hosts, default 5): with fewer, one replica's slowness is as likely the affinity
    # ring's skew (its users are the busy ones) as a fault, and ejecting it moves that load and loses its
    # caches. Consecutive failures eject at any replica count.
    outlier_latency_min_hosts: int = 5
    # Stored placements expire this long after their last write (a new prefill re-writes them); None: they live
    # as long as their replica's lease.
    placement_ttl_s: float | None = 3600.0
    # Store only placements that differ from the user's ring home over the registered replicas.
    placement_exceptions_only: bool = True


class RetryBudget:
    """Retries allowed: ``ratio`` x requests + ``minimum`` over a sliding window of ``window_s``."""

    def __init__(self, ratio: float, minimum: int, window_s: float, clock: Any = time.monotonic) -> None:
        self.ratio, self.minimum, self.window_s, self.clock = ratio, minimum, window_s, clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _prune(self, now: float) -> None:
        for q in (self._requests, self._retries):
            while q and q[0] <= now - self.window_s:
                q.popleft()

    def request(self) -> None:
        now = self.clock()
        self._prune(now)
        self._requests.append(now)

    def try_retry(self) -> bool:
        now = self.clock()
        self._prune(now)
        if len(self._retries) + 1 > self.ratio * len(self._requests) + self.minimum:
            return False
        self._retries.append(now)
        return True


class _Metrics:
    def __init__(self, router: Router) -> None:
        self.registry = r = CollectorRegistry()
        self.gc_pauses = GcPauseMetric(r, "grstack_router")
        self.requests = Counter("grstack_router_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("grstack_router_request_seconds", "request latency through the router, every "
                                 "status", ["route", "outcome"],
                                 buckets=(0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                                          1.0, 2.5, 5.0), registry=r)
        self.retries_denied = Counter("grstack_router_retries_denied", "retries refused by the retry budget",
                                      registry=r)
        self.ejections = Counter("grstack_router_ejections", "replicas ejected by outlier detection",
                                 ["reason"], registry=r)
        self.shed = Counter("grstack_router_shed", "ranks answered 503/504 under overload", ["reason"],
                            registry=r)
        self.routes = Counter("grstack_router_routes", "rank routing decisions", ["kind"], registry=r)
        self.moves = Counter("grstack_router_moves", "users sent off their placed replica", ["cause"], registry=r)
        self.retries = Counter("grstack_router_retries", "rank attempts retried on another replica", registry=r)
        self.trigger = Counter("grstack_router_trigger", "prefill signals by trigger decision", ["reason"],
                               registry=r)
        store_up = Gauge("grstack_router_store_up", "1 while the placement store is reachable", registry=r)
        store_up.set_function(lambda: float(router.store_up))
        reps = Gauge("grstack_router_replicas", "ranker replicas known to the router", ["state"], registry=r)
        reps.labels("up").set_function(lambda: len(router.up_replicas()))
        reps.labels("down").set_function(lambda: len(router.down))
        reps.labels("ejected").set_function(lambda: len(router.ejected))
        spec = Gauge("grstack_router_trigger_speculative_share", "share of recent admitted prefills whose rank "
                     "did not follow: what the trigger's load budget charges", registry=r)
        spec.set_function(lambda: router.trigger.speculative_share if router.trigger is not None else 1.0)


class Router:
    """``client``: TLS and the token of the router's requests to rankers (plain HTTP, no token when None)."""

    def __init__(self, config: RouterConfig, store: PlacementStore | None = None,
                 client: ClientSecurity | None = None) -> None:
        self.config = config
        self.client = client or ClientSecurity()
        self.store = store if store is not None else MemoryPlacementStore()
        self.replicas: dict[str, Replica] = {}
        self.placements: dict[str, Placement] = {}
        self.down: set[str] = set()
        self.inflight: dict[str, int] = {}  # rank requests in flight per replica (the routing load)
        self.inflight_other: dict[str, int] = {}  # prefills and other requests in flight per replica
        self.queued: dict[str, int] = {}  # replica -> ranks queued (hits + misses), as its last /v1/stats reported
        self.ejected: dict[str, float] = {}  # replica -> monotonic time its ejection ends
        self._ejections: dict[str, int] = {}
        self._returned: dict[str, float] = {}  # replica -> when its last ejection ended
        self._failures: dict[str, int] = {}
        self._latencies: dict[str, deque[float]] = {}
        self.retry_budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min,
                                        config.retry_budget_window_s)
        self.ring = HashRing()
        self.store_up = False
        self.synced = asyncio.Event()
        self.profile: Profile | None = None
        self.trigger: SequenceAwareTrigger | None = None
        self.metrics = _Metrics(self)
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._dns_urls: set[str] = set()
        self._home_ring = HashRing()  # over the registered replicas: where an unstored placement is
        self._unsynced: dict[str, Placement | None] = {}  # LOCAL placement -> the stored one it replaces
        self._home_seen: dict[str, float] = {}  # HOME placements by last confirmation (oldest first)
        self._store_tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=512, ssl=self.client.connector_ssl()),
            timeout=aiohttp.ClientTimeout(total=None), middlewares=self.client.middlewares())
        for url in self.config.rankers:
            await self.store.register(Replica(url, url), ttl_s=0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_loop()), loop.create_task(self._health_loop())]
        if self.config.rankers_dns:
            await self.resolve_rankers()
            self._tasks.append(loop.create_task(self._dns_loop()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.synced.wait(), 5.0)
        await self._load_profile()
        if self.config.load_poll_interval_s > 0:
            self._tasks.append(loop.create_task(self._load_loop()))

    async def stop(self) -> None:
        if self._store_tasks:  # let placement writes in flight land, so other routers keep the affinity
            await asyncio.wait(self._store_tasks, timeout=5.0)
        tasks = [*self._tasks, *self._background, *self._store_tasks]
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a task stuck in a store client must not hold up shutdown
            await asyncio.wait(tasks, timeout=5.0)
        if self._session is not None:
            await self._session.close()
        await self.store.close()
        self.metrics.gc_pauses.close()

    async def _load_profile(self) -> None:
        """Fetches the latency profile from the first ready replica (waits up to startup_timeout_s)."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            for rid in self.up_replicas():
                try:
                    async with self._http().get(self.replicas[rid].url + "/v1/profile",
                                                timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        if resp.status == 200:
                            self.set_profile(Profile.model_validate(await resp.json()))
                            return
                except (aiohttp.ClientError, TimeoutError):
                    continue
            await asyncio.sleep(0.2)
        log.warning("no ranker profile within %.0f s; prefill signals are rejected until one is loaded",
                    self.config.startup_timeout_s)

    def set_profile(self, profile: Profile) -> None:
        self.profile = profile
        model = LatencyModel.from_profile(profile.lengths, profile.full_ms, profile.cached_ms, profile.prefill_ms,
                                          profile.kv_bytes_per_token)
        self.trigger = SequenceAwareTrigger(model, self.config.trigger, enabled=self.config.relay)
        self._update_budget()

    def _update_budget(self) -> None:
        if self.trigger is not None:
            up = max(1, len(self.up_replicas()))
            budget = self.config.prefill_budget_per_replica_ms * up * self.trigger.config.window_s
            cache = self.trigger.config.cache_budget_bytes
            if self.config.cache_budget_per_replica_bytes is not None:
                cache = self.config.cache_budget_per_replica_bytes * up
            per_ranker = self.config.prefill_budget_per_replica_ms * self.trigger.config.window_s
            ranker_cache = self.config.cache_budget_per_replica_bytes
            if ranker_cache is None:
                ranker_cache = self.trigger.config.ranker_cache_budget_bytes
            new = dataclasses.replace(self.trigger.config, prefill_budget_ms=budget, cache_budget_bytes=cache,
                                      ranker_prefill_budget_ms=per_ranker, ranker_cache_budget_bytes=ranker_cache,
                                      report_interval_s=self.config.load_poll_interval_s or 1.0)
            if new != self.trigger.config:
                self.trigger.config = new

    # -- DNS discovery (a headless Service of the rankers) -------------------------------------------
    async def resolve_rankers(self) -> None:
        """Registers the addresses the Service name resolves to and unregisters those it no longer does
        (a failed lookup changes nothing: a DNS hiccup must not empty the ring)."""
        host, _, port = (self.config.rankers_dns or "").rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            log.warning("cannot resolve rankers at %s: %s", self.config.rankers_dns, exc)
            return
        urls = set()
        for family, *_, sockaddr in infos:
            ip = sockaddr[0]
            scheme = self.client.scheme
            urls.add(f"{scheme}://[{ip}]:{port}" if family == socket.AF_INET6 else f"{scheme}://{ip}:{port}")
        for url in sorted(urls - set(self._dns_urls)):
            await self.store.register(Replica(url, url), ttl_s=0)
        for url in sorted(set(self._dns_urls) - urls):
            await self.store.unregister(url)
        self._dns_urls = urls

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_interval_s)
            await self.resolve_rankers()

    def _http(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() was not called"
        return self._session

    # -- the view -----------------------------------------------------------------------------------
    def up_replicas(self) -> list[str]:
        return sorted(r for r in self.replicas if r not in self.down and r not in self.ejected)

    # -- outlier detection --------------------------------------------------------------------------
    def _release_ejections(self) -> None:
        now = time.monotonic()
        back = [r for r, until in self.ejected.items() if until <= now]
        for rid in back:
            del self.ejected[rid]
            self._returned[rid] = now
            self._failures[rid] = 0
            self._latencies.pop(rid, None)
            log.info("ranker %s returns after its ejection", rid)
        if back:
            self._refresh_ring()

    def eject(self, rid: str, reason: str) -> bool:
        cfg = self.config
        if rid in self.ejected or rid not in self.replicas:
            return False
        cap = max(1, int(cfg.outlier_max_ejected_fraction * len(self.replicas)))
        if len(self.ejected) + 1 > cap:
            return False
        now = time.monotonic()
        n = self._ejections.get(rid, 0)
        if rid in self._returned and cfg.outlier_base_ejection_s > 0:
            # the multiplier drops by one per base ejection time the replica stayed healthy since its return
            healthy = now - self._returned.pop(rid)
            n = max(0, n - int(healthy // cfg.outlier_base_ejection_s))
        n += 1
        self._ejections[rid] = n
        period = min(cfg.outlier_base_ejection_s * n, cfg.outlier_max_ejection_s)
        self.ejected[rid] = now + period
        self._failures[rid] = 0
        self.metrics.ejections.labels(reason).inc()
        log.warning("ranker %s ejected for %.1f s (%s)", rid, period, reason)
        self._refresh_ring()
        return True

    def record_failure(self, rid: str) -> None:
        n = self._failures.get(rid, 0) + 1
        self._failures[rid] = n
        if n >= self.config.outlier_consecutive_failures:
            self.eject(rid, "consecutive-failures")

    def record_success(self, rid: str, seconds: float) -> None:
        self._failures[rid] = 0
        self.record_slow(rid, seconds)

    def record_slow(self, rid: str, seconds: float) -> None:
        """A latency sample (a success, or a try cut at the request's deadline); ejects a latency outlier."""
        cfg = self.config
        if cfg.outlier_latency_factor is None:
            return
        lat = self._latencies.setdefault(rid, deque(maxlen=max(cfg.outlier_latency_min_samples, 50)))
        lat.append(seconds)
        if len(lat) < cfg.outlier_latency_min_samples:
            return
        others = [statistics.median(v) for r, v in self._latencies.items()
                  if r != rid and r in self.replicas and r not in self.ejected
                  and len(v) >= cfg.outlier_latency_min_samples]
        if len(others) + 1 < cfg.outlier_latency_min_hosts or not others:
            return
        mine, theirs = statistics.median(lat), statistics.median(others)
        if mine * 1e3 > cfg.outlier_latency_floor_ms and mine > cfg.outlier_latency_factor * theirs:
            self.eject(rid, "latency")

    def _refresh_ring(self) -> None:
        self.ring.set_nodes(self.up_replicas())
        self._update_budget()

    def apply(self, ev: Event) -> None:
        """Applies a store event to the local view (the store's word wins over a settled local entry)."""
        members = set(self.replicas)
        if ev.kind == "snapshot":
            self.replicas = {r.id: r for r in ev.replicas}
            stored = {p.user: p for p in ev.placements if p.replica in self.replicas}
            # LOCAL entries wait for the write-back (which decides against the store); HOME ones are not stored
            kept = {u: p for u, p in self.placements.items() if p.replica in self.replicas and (
                p.revision == LOCAL or (p.revision == HOME and u not in stored))}
            self.placements = {**stored, **kept}
            self.synced.set()
        elif ev.kind == "replica" and ev.replica is not None:
            self.replicas[ev.replica.id] = ev.replica
        elif ev.kind == "replica-gone":
            self.replicas.pop(ev.key, None)
            self.down.discard(ev.key)
            self.placements = {u: p for u, p in self.placements.items() if p.replica != ev.key}
        elif ev.kind == "placement" and ev.placement is not None:
            self._settle(ev.placement)
        elif ev.kind == "placement-gone":  # deleted or expired; a HOME or LOCAL entry was never the stored one
            current = self.placements.get(ev.key)
            if current is not None and current.revision > 0:
                del self.placements[ev.key]
        if ev.kind == "snapshot" or set(self.replicas) != members:
            self._home_ring.set_nodes(self.replicas)
            self._pin_moved_homes()
            self._unsynced = {u: e for u, e in self._unsynced.items()
                              if u in self.placements and self.placements[u].revision == LOCAL}
            if self._unsynced or any(p.revision == LOCAL for p in self.placements.values()):
                self._schedule_write_back()
        self._refresh_ring()

    # -- placements in the store --------------------------------------------------------------------
    # The store holds only exceptions: a placement on the user's ring home (the first replica in its hash-ring
    # order over the registered replicas, the same on every router) is derived, not written, and kept in the
    # view as HOME; stored placements expire placement_ttl_s after their last write (each prefill re-writes).
    # Placements made while the store is unreachable stay LOCAL and are written back (CAS) when it returns.
    def home(self, user: str) -> str | None:
        """The user's ring home: the first registered replica in its ring order (the same on every router
        that sees the same replicas, whatever their health), where a placement needs no store entry."""
        order = self._home_ring.order(user)
        return order[0] if order else None

    def _pin_moved_homes(self) -> None:
        """A replica joined or left and moved some users' ring home away from where their prefix is: those
        placements become exceptions, to be written (otherwise every router would route them to the new home,
        a cache miss)."""
        if not self.config.placement_exceptions_only:
            return
        for user, p in list(self.placements.items()):
            if p.revision == HOME and self.home(user) != p.replica:
                self.placements[user] = dataclasses.replace(p, revision=LOCAL)
                self._unsynced[user] = None
                self._home_seen.pop(user, None)

    def _settle(self, placement: Placement) -> None:
        self.placements[placement.user] = placement
        self._unsynced.pop(placement.user, None)
        self._home_seen.pop(placement.user, None)

    def _set_home(self, user: str, replica: str, version: str) -> None:
        self._settle(Placement(user, replica, version, HOME))
        self._home_seen[user] = time.monotonic()
        ttl = self.config.placement_ttl_s
        if ttl is None:
            return
        cutoff = time.monotonic() - ttl  # HOME entries expire from the view like stored ones from the store
        old = []
        for u, seen in self._home_seen.items():
            if seen > cutoff:
                break
            old.append(u)
        for u in old:
            del self._home_seen[u]
            if (p := self.placements.get(u)) is not None and p.revision == HOME:
                del self.placements[u]

    def _keep_local(self, user: str, replica: str, version: str, expected: Placement | None) -> None:
        self.placements[user] = Placement(user, replica, version, LOCAL)
        self._unsynced[user] = expected
        self._home_seen.pop(user, None)

    def _schedule_write_back(self) -> None:
        if not self.store_up or any(not t.done() for t in self._store_tasks):
            return  # a running write-back picks up what was added
        try:
            task = asyncio.get_running_loop().create_task(self._write_back())
        except RuntimeError:  # no loop: the view is being set up by hand
            return
        self._store_tasks.add(task)
        task.add_done_callback(self._store_tasks.discard)

    async def _write_back(self) -> None:
        """Writes the LOCAL placements (made while the store was unreachable, or pinned after a ring change) to
        the store with compare-and-swap against what they replaced; a placement another router wrote meanwhile
        wins and the view adopts it. Stops when the store is lost again (the next snapshot restarts it)."""
        tried: set[Placement] = set()
        while self.store_up:
            todo = [p for p in self.placements.values() if p.revision == LOCAL and p not in tried]
            if not todo:
                return
            for p in todo:
                tried.add(p)
                if self.placements.get(p.user) != p:
                    continue  # changed meanwhile (a watch event or a new prefill)
                try:
                    await self._store_placement(p.user, p.version, p.replica, self._unsynced.get(p.user))
                except StoreUnavailable as exc:
                    log.info("placement write-back paused, store unavailable: %s", exc)
                    return

    async def _store_placement(self, user: str, version: str, replica: str, expected: Placement | None) -> str:
        """Makes the store say user -> replica given that it held ``expected``; returns the replica that won."""
        cfg = self.config
        at_home = cfg.placement_exceptions_only and replica == self.home(user)
        if at_home and expected is None:
            self._set_home(user, replica, version)
            return replica
        if at_home:
            assert expected is not None
            if await self.store.delete_placement(user, expected):
                self._set_home(user, replica, version)
                return replica
        elif cfg.placement_ttl_s is None and expected is not None and expected.replica == replica:
            self._settle(expected)  # stored already and it does not expire: nothing to refresh
            return replica
        else:
            placed = await self.store.cas_placement(user, replica, version, expected, cfg.placement_ttl_s)
            if placed is not None:
                self._settle(placed)
                return replica
        # The compare failed: another router changed the placement. Its placement wins while its replica is up.
        winner = await self.store.get_placement(user)
        if winner is not None and winner.replica in self.up_replicas():
            self._settle(winner)
            return winner.replica
        if at_home:
            if winner is None or await self.store.delete_placement(user, winner):
                self._set_home(user, replica, version)
                return replica
        elif (placed := await self.store.cas_placement(user, replica, version, winner, cfg.placement_ttl_s)):
            self._settle(placed)
            return replica
        self._unsynced.pop(user, None)  # lost twice: the watch brings the winner
        self.placements.pop(user, None)
        return replica

    async def _watch_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                async for ev in self.store.watch():
                    self.store_up = True
                    backoff = 0.1
                    self.apply(ev)
            except StoreUnavailable as exc:
                if self.store_up:
                    log.warning("placement store unavailable, routing on the local view and the hash ring: %s",
                                exc)
            except Exception:
                log.exception("placement watch failed")
            self.store_up = False
            self.synced.set()  # nothing to wait for: route on what we have
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(rid) for rid in list(self.replicas)), return_exceptions=True)
            await asyncio.sleep(self.config.health_interval_s)

    async def _probe(self, rid: str) -> None:
        replica = self.replicas.get(rid)
        if replica is None:
            return
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._http().get(replica.url + "/readyz", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                ok = resp.status == 200
        if ok and rid in self.down:
            self.down.discard(rid)
            self._refresh_ring()
        elif not ok and rid not in self.down:
            self.mark_down(rid)

    # -- load reports -------------------------------------------------------------------------------
    async def _load_loop(self) -> None:
        while True:
            await self.poll_load()
            await asyncio.sleep(self.config.load_poll_interval_s)

    async def poll_load(self) -> None:
        """Reads every up ranker's ``/v1/stats`` into the routing view (queue depth) and the trigger."""
        await asyncio.gather(*(self._poll_stats(rid) for rid in self.up_replicas()), return_exceptions=True)
        for rid in [r for r in self.queued if r not in self.replicas]:
            del self.queued[rid]

    async def _poll_stats(self, rid: str) -> None:
        replica = self.replicas.get(rid)
        if replica is None:
            return
        stats: Any = None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with self._http().get(replica.url + "/v1/stats", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    stats = await resp.json()
        if not isinstance(stats, dict):
            stats = None
            self.queued.pop(rid, None)
        else:
            # Ranks waiting there (cached and misses); queued prefills are background work that delays a rank
            # by one compute step at most, so they do not count towards moving a user off its cached prefix.
            depth = stats.get("queue_depth")
            if isinstance(depth, dict) and ("hits" in depth or "misses" in depth):
                queued = int(depth.get("hits", 0)) + int(depth.get("misses", 0))
            else:
                queued = int(stats.get("queued") or 0)
            self.queued[rid] = queued
        if self.trigger is not None:
            self.trigger.report(rid, stats)

    def load_view(self) -> dict[str, int]:
        """Rank requests on each up replica: this router's in flight, or the rank queue the ranker reported if
        longer. Prefills are not counted: one held open while its prefix computes is background work, and
        counting it moved users off the replica holding their prefix to a miss elsewhere (18 of 1,250 ranks,
        each a full inference, at 512 tokens and 40 QPS)."""
        return {r: max(self.inflight.get(r, 0), self.queued.get(r, 0)) for r in self.up_replicas()}

    def over_cap(self, rid: str, load: dict[str, int]) -> bool:
        mine = load.get(rid, 0)
        if len(load) < 2 or mine < self.config.overload_min_load:
            return False
        return mine > self.config.load_factor * sum(load.values()) / len(load)

    def mark_down(self, rid: str) -> None:
        if rid not in self.down:
            log.warning("ranker %s is down", rid)
            self.down.add(rid)
            self._refresh_ring()

    # -- routing ------------------------------------------------------------------------------------
    def route(self, user: str) -> tuple[list[str], str]:
        """Replicas to try for ``user`` in order, and how the first was chosen (affinity | moved | ring |
        random). A placed user whose replica is over its load cap is ``moved`` to the bounded-load ring's
        choice among the others: affinity does not override the cap."""
        if self.ejected:
            self._release_ejections()
        up = self.up_replicas()
        if not self.config.affinity:
            shuffled = random.sample(up, len(up))
            return shuffled[: self.config.max_attempts], "random"
        placed = self.placements.get(user)
        load = self.load_view()
        first: str | None
        if placed is not None and placed.replica in up:
            first, kind = placed.replica, "affinity"
            if self.over_cap(placed.replica, load):
                other = self.ring.choose(user, load, self.config.load_factor, exclude=(placed.replica,))
                if other is not None and not self.over_cap(other, load):
                    first, kind = other, "moved"
        else:
            first, kind = self.ring.choose(user, load, self.config.load_factor), "ring"
        if first is None:
            return [], kind
        rest = [r for r in self.ring.order(user) if r != first]
        return [first, *rest][: self.config.max_attempts], kind

    async def _post(self, rid: str, path: str, body: bytes, timeout_s: float,
                    headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        status, payload, _ = await self._post_full(rid, path, body, timeout_s, headers)
        return status, payload

    async def _post_full(self, rid: str, path: str, body: bytes, timeout_s: float,
                         headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        url = self.replicas[rid].url + path
        counter = self.inflight if path == "/v1/rank" else self.inflight_other
        counter[rid] = counter.get(rid, 0) + 1
        try:
            async with self._http().post(url, data=body,
                                         headers={"Content-Type": "application/json", **(headers or {})},
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status, await resp.read(), dict(resp.headers)
        finally:
            counter[rid] -= 1

    async def rank(self, body: bytes, req: RankRequest, client_budget_ms: float | None = None) -> web.Response:
        start = time.monotonic()
        budget_ms = self.config.rank_budget_ms
        if budget_ms is None:
            budget_ms = self.config.rank_timeout_s * 1e3
        if client_budget_ms is not None:
            budget_ms = min(budget_ms, client_budget_ms)
        deadline = start + budget_ms / 1e3
        order, kind = self.route(req.user_id)
        if not order:
            raise RequestError(503, "no ranker replica is available")
        if self.trigger is not None:
            self.trigger.consumed(req.user_id)  # the prefix pre-inferred for this visit has served its purpose
        self.metrics.routes.labels(kind).inc()
        if kind == "moved":
            self.metrics.moves.labels("load").inc()
        self.retry_budget.request()
        last_error, shed_retry_after, shed_reason = "", None, "queue-full"
        for attempt, rid in enumerate(order):
            if rid not in self.replicas:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.metrics.shed.labels("deadline").inc()
                return error_response(504, f"deadline exceeded after {attempt} attempt(s) ({last_error})",
                                      headers={"X-Grstack-Shed": "deadline"})
            if attempt:
                if not self.retry_budget.try_retry():
                    self.metrics.retries_denied.inc()
                    last_error += "; retry budget exhausted"
                    break
                self.metrics.retries.inc()
            t0 = time.monotonic()
            budget_bound = remaining < self.config.rank_timeout_s  # this try ends at the request's deadline
            try:
                status, payload, headers = await self._post_full(
                    rid, "/v1/rank", body, min(self.config.rank_timeout_s, remaining),
                    {DEADLINE_HEADER: f"{remaining * 1e3:.1f}"})
            except aiohttp.ClientConnectorError as exc:
                last_error = f"{rid}: {type(exc).__name__}"
                self.mark_down(rid)  # nothing listens: down until /readyz answers
                continue
            except TimeoutError as exc:
                if budget_bound:
                    # The deadline passed while the ranker worked on it: shed (504), never retried. Under load
                    # every replica is late alike, so this is a latency sample for outlier detection (a hung
                    # replica stands out against the others), not a failure that ejects.
                    self.record_slow(rid, time.monotonic() - t0)
                    self.metrics.shed.labels("deadline").inc()
                    return error_response(504, f"deadline exceeded: {rid} did not answer within the "
                                               f"{budget_ms:.0f} ms budget",
                                          headers={"X-Grstack-Shed": "deadline",
                                                   "X-Grstack-Attempts": str(attempt + 1)})
                last_error = f"{rid}: {type(exc).__name__}"
                self.record_failure(rid)  # slow is not down: outlier detection decides
                continue
            except aiohttp.ClientError as exc:
                last_error = f"{rid}: {type(exc).__name__}"
                self.record_failure(rid)
                continue
            if status == 504:  # the ranker dropped it at its deadline: nobody waits for a retry
                self.metrics.shed.labels("deadline").inc()
                return web.Response(status=status, body=payload, content_type="application/json",
                                    headers={"X-Grstack-Shed": "deadline", "X-Grstack-Attempts": str(attempt + 1)})
            if status == 503 and headers.get("X-Grstack-Shed") in ("queue-full", "predicted-late"):
                shed_reason = headers["X-Grstack-Shed"]
                last_error = f"{rid}: {shed_reason}"
                shed_retry_after = headers.get("Retry-After", "1")
                continue  # overload is not a fault: no outlier count
            if status >= 500:
                last_error = f"{rid}: HTTP {status}"
                self.record_failure(rid)
                continue
            if status in (401, 403):  # the router's own token or certificate was refused: not the client's fault
                log.warning("ranker %s refused the router's credentials (HTTP %d): check --ranker-token-file "
                            "and --ranker-cert", rid, status)
                last_error = f"{rid}: refused the router's credentials (HTTP {status})"
                continue
            self.record_success(rid, time.monotonic() - t0)
            return web.Response(status=status, body=payload, content_type="application/json",
                                headers={"X-Grstack-Route": kind, "X-Grstack-Attempts": str(attempt + 1)})
        if shed_retry_after is not None:
            self.metrics.shed.labels(shed_reason).inc()
            return error_response(503, f"overloaded: every ranker tried refused it ({last_error})",
                                  headers={"Retry-After": shed_retry_after, "X-Grstack-Shed": shed_reason})
        raise RequestError(503, f"every ranker replica failed ({last_error})")

    # -- prefill ------------------------------------------------------------------------------------
    async def prefill(self, body: bytes, req: PrefillRequest) -> RouterPrefillResponse:
        user = req.user_id
        if self.trigger is None or self.profile is None:
            self.metrics.trigger.labels("no-profile").inc()
            return RouterPrefillResponse(user_id=user, admitted=False, reason="no-profile", replica=None,
                                         prefix_len=len(req.long_term.items), predicted_full_ms=0.0)
        max_prefix = self.profile.max_len - self.profile.max_suffix
        items, ts = truncate_prefix(req.long_term.items, req.long_term.timestamps, max_prefix)
        actions = None
        if self.profile.action_names:  # the rankers' model reads actions: they are part of the prefix's version
            if req.long_term.actions is None:
                raise RequestError(422, "long_term.actions: the served model reads each event's actions ("
                                        f"{', '.join(self.profile.action_names)}); the request has none")
            actions = np.asarray(req.long_term.actions, dtype=np.int64)[-max_prefix:]
        version = prefix_hash(items, ts, actions, context_key(req.user_features, self.profile.user_fields))
        order, kind = self.route(user)
        replica = order[0] if order else None
        tokens = len(items) + len(self.profile.user_fields)  # the contextual tokens head a prefix too
        decision = self.trigger.decide(user, version, tokens, replica)
        if decision.reason == "load-budget" and replica is not None and kind != "random":
            # the replica's prefill budget is spent: the prefill goes where the bounded-load ring says
            other = self.ring.choose(user, self.load_view(), self.config.load_factor, exclude=(replica,))
            if other is not None:
                moved = self.trigger.decide(user, version, tokens, other)
                if moved.admitted:
                    decision, replica = moved, other
                    self.metrics.moves.labels("prefill-budget").inc()
        self.metrics.trigger.labels(decision.reason).inc()
        out = RouterPrefillResponse(user_id=user, admitted=decision.admitted, reason=decision.reason,
                                    replica=None, prefix_len=len(items),
                                    predicted_full_ms=decision.predicted_full_ms)
        if not decision.admitted:
            return out
        if replica is None:
            self.trigger.forget(user)
            return out.model_copy(update={"admitted": False, "reason": "no-replica"})
        current = self.placements.get(user)
        if current is None or current.replica != replica:
            self.placements[user] = Placement(user, replica, version, LOCAL)
        task = asyncio.get_running_loop().create_task(self._place_and_prefill(
            user, version, replica, current, body, recharge=decision.reason == "live"))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if req.wait:
            ranker = await asyncio.shield(task)
            return out.model_copy(update={"replica": ranker.replica if ranker else replica, "ranker": ranker})
        return out.model_copy(update={"replica": replica})

    async def _place(self, user: str, version: str, replica: str, seen: Placement | None) -> str:
        """Records user -> replica in the store (CAS; only an exception to the ring home is written, with the
        TTL, so a new prefill refreshes it); returns the replica that won. With the store unreachable the
        placement stays LOCAL and is written back when the store returns."""
        if seen is not None and seen.revision == LOCAL:
            expected = self._unsynced.get(user)
        else:
            expected = seen if seen is not None and seen.revision > 0 else None
        if not self.store_up:
            self._keep_local(user, replica, version, expected)
            return replica
        try:
            return await self._store_placement(user, version, replica, expected)
        except StoreUnavailable:
            self._keep_local(user, replica, version, expected)
            return replica

    async def _place_and_prefill(self, user: str, version: str, replica: str, seen: Placement | None,
                                 body: bytes, recharge: bool = False) -> PrefillResponse | None:
        """``recharge``: the trigger admitted the signal as live, uncharged; if the ranker computed the prefix
        all the same (it had evicted it), that prefill is charged now."""
        replica = await self._place(user, version, replica, seen)
        try:
            status, payload = await self._post(replica, "/v1/prefill", body, self.config.prefill_timeout_s)
        except (aiohttp.ClientError, TimeoutError, KeyError) as exc:
            log.warning("prefill for %s on %s failed: %s", user, replica, type(exc).__name__)
            if self.trigger is not None:
                self.trigger.forget(user)
            return None
        if status != 200:
            log.warning("prefill for %s on %s answered %d: %s", user, replica, status, payload[:200])
            if self.trigger is not None:
                self.trigger.forget(user)
            return None
        done = PrefillResponse.model_validate_json(payload)
        if recharge and done.status == "computed" and self.trigger is not None:
            head = len(self.profile.user_fields) if self.profile is not None else 0
            self.trigger.charge(user, version, done.prefix_len + head, replica)
            self.metrics.trigger.labels("live-recomputed").inc()
        return done


# -- HTTP ---------------------------------------------------------------------------------------------
ROUTES: list[dict[str, Any]] = [
    {"method": "POST", "path": "/v1/prefill",
     "summary": "pre-infer signal: admitted by the sequence-aware trigger, sent to the user's replica",
     "request": PrefillRequest, "responses": {200: RouterPrefillResponse}},
    {"method": "POST", "path": "/v1/rank", "summary": "rank on the replica holding the user's prefix",
     "request": RankRequest, "responses": {200: RankResponse, 503: None}},
    {"method": "GET", "path": "/v1/replicas", "summary": "the router's view of replicas and the store",
     "responses": {200: Health}},
    {"method": "GET", "path": "/healthz", "summary": "liveness", "responses": {200: Health}},
    {"method": "GET", "path": "/readyz", "summary": "readiness: at least one ranker is up",
     "responses": {200: Health, 503: Health}},
    {"method": "GET", "path": "/metrics", "summary": "Prometheus metrics", "responses": {200: None}},
]


def make_router_app(router: Router, security: ServerSecurity | None = None) -> web.Application:
    """``security``: the tokens, client certificates, open paths and body timeout its guard enforces."""
    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        t0 = time.perf_counter()
        resp = await handler(request)
        route = route_template(request)
        router.metrics.requests.labels(route, str(resp.status)).inc()
        router.metrics.latency.labels(route, status_class(resp.status)).observe(time.perf_counter() - t0)
        return resp

    app = web.Application(client_max_size=router.config.max_body_bytes, middlewares=[count, json_errors,
                                                                                   guard(security or ServerSecurity())])
    app[MAX_BODY] = router.config.max_body_bytes

    async def prefill(request: web.Request) -> web.Response:
        req = await parse_body(request, PrefillRequest)
        return model_response(await router.prefill(await request.read(), req))

    async def rank(request: web.Request) -> web.Response:
        client_budget = parse_deadline_ms(request.headers.get(DEADLINE_HEADER))
        req = await parse_body(request, RankRequest)
        return await router.rank(await request.read(), req, client_budget)

    def view() -> dict[str, Any]:
        return {"store_up": router.store_up, "up": router.up_replicas(), "down": sorted(router.down),
                "ejected": sorted(router.ejected), "load": router.load_view(),
                "replicas": {r.id: r.url for r in router.replicas.values()}, "placements": len(router.placements),
                "profile": router.profile is not None}

    async def replicas(_: web.Request) -> web.Response:
        return model_response(Health(status="ok", detail=view()))

    async def healthz(_: web.Request) -> web.Response:
        return model_response(Health(status="ok"))

    async def readyz(_: web.Request) -> web.Response:
        ok = bool(router.up_replicas())
        return model_response(Health(status="ok" if ok else "unavailable", detail=view()), 200 if ok else 503)

    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/rank", rank)
    app.router.add_get("/v1/replicas", replicas)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler(router.metrics.registry))
    app.router.add_get("/openapi.json", openapi_handler(openapi_document("grstack router", "v1", ROUTES)))

    async def _stop(_: web.Application) -> None:
        await router.stop()

    app.on_cleanup.append(_stop)
    return app


async def start_router(router: Router, host: str = "127.0.0.1", port: int = 0,
                       security: ServerSecurity | None = None) -> tuple[web.AppRunner, str]:
    from grstack.runtime.serve.http import start_site

    app = make_router_app(router, security)
    await router.start()
    runner, url = await start_site(app, host, port, security)
    return runner, url


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

The router is a composition of parts with one job each: :class:`ReplicaHealth` (down and ejected replicas,
router_health.py), :class:`LoadView` (in-flight and reported queues, router_load.py), :class:`PlacementBook`
(the placement view and its write-back, router_placement.py), :class:`Forwarder` (rank attempts and retries,
router_forward.py) and :class:`DnsDiscovery` (router_dns.py), over one :class:`RankerTransport` (HTTP, or in
process) and one injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time  # noqa: F401 -- not read here (the clock reads it); tests patch router.time.monotonic
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grstack.runtime.serve.clock import Clock, SystemClock, wait_for
from grstack.runtime.serve.gc_pauses import GcPauseMetric
from grstack.runtime.serve.http import (
    DEADLINE_HEADER,
    MAX_BODY,
    ROUTER_MS_HEADER,
    RequestError,
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
from grstack.runtime.serve.router_config import RouterConfig
from grstack.runtime.serve.router_dns import DnsDiscovery
from grstack.runtime.serve.router_forward import Forwarder, RetryBudget
from grstack.runtime.serve.router_health import ReplicaHealth
from grstack.runtime.serve.router_load import LoadView
from grstack.runtime.serve.router_placement import HOME, LOCAL, PlacementBook
from grstack.runtime.serve.schemas import (
    Health,
    PrefillRequest,
    PrefillResponse,
    Profile,
    RankRequest,
    RankResponse,
    RouterPrefillResponse,
)
from grstack.runtime.serve.security import ClientSecurity, ServerSecurity, guard
from grstack.runtime.serve.transport import HttpTransport, RankerTransport, TransportError
from grstack.runtime.serve.trigger import LatencyModel, SequenceAwareTrigger

__all__ = ["HOME", "LOCAL", "RetryBudget", "Router", "RouterConfig", "make_router_app", "start_router"]

log = logging.getLogger(__name__)


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
    """Routes prefill signals (through the trigger) and ranks (by affinity) to rankers. ``client``: TLS and the
    token of the router's requests to rankers (plain HTTP, no token when None); ``transport``: how rankers are
    reached (HTTP with ``client`` when None); ``clock``: the time of deadlines, windows and ejections, and what
    the router's loops sleep on (the system's when None)."""

    def __init__(self, config: RouterConfig, store: PlacementStore | None = None,
                 client: ClientSecurity | None = None, *, transport: RankerTransport | None = None,
                 clock: Clock | None = None, rng: random.Random | None = None) -> None:
        self.config = config
        # the draws of random routing (the no-affinity ablation); injected so that a simulated run repeats
        self.rng = rng if rng is not None else random.Random()
        self.client = client or ClientSecurity()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.transport: RankerTransport = transport if transport is not None else HttpTransport(self.client)
        self.store = store if store is not None else MemoryPlacementStore(self.clock)
        self.replicas: dict[str, Replica] = {}
        self.ring = HashRing()
        self.synced = asyncio.Event()
        self.profile: Profile | None = None
        self.trigger: SequenceAwareTrigger | None = None
        self.metrics = _Metrics(self)
        self.health = ReplicaHealth(config, self.clock, lambda: self.replicas, self._refresh_ring,
                                    lambda reason: self.metrics.ejections.labels(reason).inc())
        self.load = LoadView(config, self._report)
        self.book = PlacementBook(config, self.store, self.clock,
                                  lambda rid: rid in self.replicas and self.health.usable(rid))
        self.forward = Forwarder(config, self.clock, self.transport, lambda: self.replicas, self.health, self.load,
                                 self.metrics.shed, self.metrics.retries, self.metrics.retries_denied)
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self.dns = (DnsDiscovery(config.rankers_dns, self.client.scheme, self.store, self.clock,
                                 config.dns_interval_s) if config.rankers_dns else None)

    # -- the parts' state, under the names the rest of the code reads -------------------------------
    @property
    def down(self) -> set[str]:
        return self.health.down

    @down.setter
    def down(self, value: set[str]) -> None:
        self.health.down = value

    @property
    def ejected(self) -> dict[str, float]:
        return self.health.ejected

    @property
    def inflight(self) -> dict[str, int]:
        return self.load.inflight

    @inflight.setter
    def inflight(self, value: dict[str, int]) -> None:
        self.load.inflight = value

    @property
    def inflight_other(self) -> dict[str, int]:
        return self.load.inflight_other

    @property
    def queued(self) -> dict[str, int]:
        return self.load.queued

    @queued.setter
    def queued(self, value: dict[str, int]) -> None:
        self.load.queued = value

    @property
    def placements(self) -> dict[str, Placement]:
        return self.book.placements

    @placements.setter
    def placements(self, value: dict[str, Placement]) -> None:
        self.book.placements = value

    @property
    def store_up(self) -> bool:
        return self.book.store_up

    @store_up.setter
    def store_up(self, value: bool) -> None:
        self.book.store_up = value

    @property
    def retry_budget(self) -> RetryBudget:
        return self.forward.retry_budget

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.transport.start()
        for url in self.config.rankers:
            await self.store.register(Replica(url, url), ttl_s=0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch_loop()), loop.create_task(self._health_loop())]
        if self.dns is not None:
            await self.dns.resolve()
            self._tasks.append(loop.create_task(self.dns.loop()))
        with contextlib.suppress(TimeoutError):
            await wait_for(self.clock, self.synced.wait(), 5.0)
        await self._load_profile()
        if self.config.load_poll_interval_s > 0:
            self._tasks.append(loop.create_task(self._load_loop()))

    async def stop(self) -> None:
        if self.book.tasks:  # let placement writes in flight land, so other routers keep the affinity
            await asyncio.wait(self.book.tasks, timeout=5.0)
        tasks = [*self._tasks, *self._background, *self.book.tasks]
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a task stuck in a store client must not hold up shutdown
            await asyncio.wait(tasks, timeout=5.0)
        await self.transport.close()
        await self.store.close()
        self.metrics.gc_pauses.close()

    async def _load_profile(self) -> None:
        """Fetches the latency profile from the first ready replica (waits up to startup_timeout_s)."""
        deadline = self.clock() + self.config.startup_timeout_s
        while self.clock() < deadline:
            for rid in self.up_replicas():
                try:
                    reply = await self.transport.get(self.replicas[rid].url, "/v1/profile", 2.0)
                    if reply.status == 200:
                        self.set_profile(Profile.model_validate(reply.json()))
                        return
                except (TransportError, TimeoutError):
                    continue
            await self.clock.sleep(0.2)
        log.warning("no ranker profile within %.0f s; prefill signals are rejected until one is loaded",
                    self.config.startup_timeout_s)

    def set_profile(self, profile: Profile) -> None:
        self.profile = profile
        self.trigger = SequenceAwareTrigger(LatencyModel.of(profile), self.config.trigger, clock=self.clock, enabled=self.config.relay)
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

    # -- DNS discovery (router_dns.py) --------------------------------------------------------------
    async def resolve_rankers(self) -> None:
        """Registers the rankers the Service name resolves to now (:meth:`DnsDiscovery.resolve`)."""
        if self.dns is not None:
            await self.dns.resolve()

    # -- the view -----------------------------------------------------------------------------------
    def up_replicas(self) -> list[str]:
        return sorted(r for r in self.replicas if self.health.usable(r))

    def _refresh_ring(self) -> None:
        self.ring.set_nodes(self.up_replicas())
        self._update_budget()

    # -- health (router_health.py) ------------------------------------------------------------------
    def _release_ejections(self) -> None:
        self.health.release_ejections()

    def eject(self, rid: str, reason: str) -> bool:
        return self.health.eject(rid, reason)

    def record_failure(self, rid: str) -> None:
        self.health.record_failure(rid)

    def record_success(self, rid: str, seconds: float) -> None:
        self.health.record_success(rid, seconds)

    def record_slow(self, rid: str, seconds: float) -> None:
        self.health.record_slow(rid, seconds)

    def mark_down(self, rid: str) -> None:
        self.health.mark_down(rid)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.health.probe(rid, self.replicas, self.transport)
                                   for rid in list(self.replicas)), return_exceptions=True)
            await self.clock.sleep(self.config.health_interval_s)

    # -- load (router_load.py) ----------------------------------------------------------------------
    async def _load_loop(self) -> None:
        while True:
            await self.poll_load()
            await self.clock.sleep(self.config.load_poll_interval_s)

    async def poll_load(self) -> None:
        """Reads every up ranker's ``/v1/stats`` into the routing view (queue depth) and the trigger."""
        await self.load.poll(self.up_replicas(), self.replicas, self.transport)

    def _report(self, rid: str, stats: dict[str, Any] | None) -> None:
        if self.trigger is not None:
            self.trigger.report(rid, stats)

    def load_view(self) -> dict[str, int]:
        """Rank requests on each up replica (:meth:`LoadView.view`)."""
        return self.load.view(self.up_replicas())

    def over_cap(self, rid: str, load: dict[str, int]) -> bool:
        return self.load.over_cap(rid, load)

    # -- placements (router_placement.py) -----------------------------------------------------------
    def apply(self, ev: Event) -> None:
        """Applies a store event to the local view (the store's word wins over a settled local entry)."""
        members = set(self.replicas)
        if ev.kind == "snapshot":
            self.replicas = {r.id: r for r in ev.replicas}
        elif ev.kind == "replica" and ev.replica is not None:
            self.replicas[ev.replica.id] = ev.replica
        elif ev.kind == "replica-gone":
            self.replicas.pop(ev.key, None)
            self.health.down.discard(ev.key)
        self.book.apply(ev, self.replicas)
        if ev.kind == "snapshot":
            self.synced.set()
        if ev.kind == "snapshot" or set(self.replicas) != members:
            self.book.members_changed(self.replicas)
        self._refresh_ring()

    def home(self, user: str) -> str | None:
        """The user's ring home (:meth:`PlacementBook.home`)."""
        return self.book.home(user)

    async def _place(self, user: str, version: str, replica: str, seen: Placement | None) -> str:
        """Records user -> replica in the store (:meth:`PlacementBook.place`); returns the replica that won."""
        return await self.book.place(user, version, replica, seen)

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
            await self.clock.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

    # -- routing ------------------------------------------------------------------------------------
    def route(self, user: str, prefix_len: int | None = None) -> tuple[list[str], str]:
        """Replicas to try for ``user`` in order, and how the first was chosen (affinity | moved | ring |
        random). A placed user whose replica is over its load cap is ``moved`` to the bounded-load ring's
        choice among the others — unless, for a request of ``prefix_len`` events, waiting there costs less than
        computing the prefix elsewhere (:meth:`_worth_moving`)."""
        if self.ejected:
            self._release_ejections()
        up = self.up_replicas()
        if not self.config.affinity:
            shuffled = self.rng.sample(up, len(up))
            return shuffled[: self.config.max_attempts], "random"
        placed = self.placements.get(user)
        load = self.load_view()
        first: str | None
        if placed is not None and placed.replica in up:
            first, kind = placed.replica, "affinity"
            if self.over_cap(placed.replica, load) and self._worth_moving(placed.replica, load, prefix_len):
                other = self.ring.choose(user, load, self.config.load_factor, exclude=(placed.replica,))
                if other is not None and not self.over_cap(other, load):
                    first, kind = other, "moved"
        else:
            first, kind = self.ring.choose(user, load, self.config.load_factor), "ring"
        if first is None:
            return [], kind
        rest = [r for r in self.ring.order(user) if r != first]
        return [first, *rest][: self.config.max_attempts], kind

    def _worth_moving(self, replica: str, load: dict[str, int], prefix_len: int | None) -> bool:
        """Whether a user whose prefix ``replica`` holds (or is computing) should leave it: the ranks queued there,
        each at least a cached rank at this length, wait longer than the user's prefix takes to compute from
        scratch elsewhere (the rankers' profile, idle). A move turns a hit into a full inference on the critical
        path, so a long prefix stays behind a queue that a short one would leave (RelayGR routes a
        pre-inferred prefix's rank to where it was produced). Unknown length or no profile yet: the load cap
        alone decides."""
        if prefix_len is None or self.trigger is None:
            return True
        model = self.trigger.model
        return load.get(replica, 0) * model.predict_cached_ms(prefix_len) > model.predict_full_ms(prefix_len)

    async def rank(self, body: bytes, req: RankRequest, client_budget_ms: float | None = None) -> web.Response:
        start = self.clock()
        budget_ms = self.config.rank_budget_ms
        if budget_ms is None:
            budget_ms = self.config.rank_timeout_s * 1e3
        if client_budget_ms is not None:
            budget_ms = min(budget_ms, client_budget_ms)
        deadline = start + budget_ms / 1e3
        order, kind = self.route(req.user_id, len(req.long_term.items))
        if not order:
            raise RequestError(503, "no ranker replica is available")
        if self.trigger is not None:
            self.trigger.consumed(req.user_id)  # the prefix pre-inferred for this visit has served its purpose
        self.metrics.routes.labels(kind).inc()
        if kind == "moved":
            self.metrics.moves.labels("load").inc()
        return await self.forward.rank(body, order, kind, deadline, budget_ms)

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
        order, kind = self.route(user, len(items))
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

    async def _place_and_prefill(self, user: str, version: str, replica: str, seen: Placement | None,
                                 body: bytes, recharge: bool = False) -> PrefillResponse | None:
        """``recharge``: the trigger admitted the signal as live, uncharged; if the ranker computed the prefix
        all the same (it had evicted it), that prefill is charged now."""
        replica = await self._place(user, version, replica, seen)
        try:
            reply = await self.forward.post(replica, "/v1/prefill", body, self.config.prefill_timeout_s)
        except (TransportError, TimeoutError, KeyError) as exc:
            log.warning("prefill for %s on %s failed: %s", user, replica, type(exc).__name__)
            if self.trigger is not None:
                self.trigger.forget(user)
            return None
        status, payload = reply.status, reply.body
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
        t0 = router.clock()
        resp = await handler(request)
        route = route_template(request)
        router.metrics.requests.labels(route, str(resp.status)).inc()
        router.metrics.latency.labels(route, status_class(resp.status)).observe(router.clock() - t0)
        return resp

    app = web.Application(client_max_size=router.config.max_body_bytes, middlewares=[count, json_errors,
                                                                                   guard(security or ServerSecurity())])
    app[MAX_BODY] = router.config.max_body_bytes

    async def prefill(request: web.Request) -> web.Response:
        req = await parse_body(request, PrefillRequest)
        return model_response(await router.prefill(await request.read(), req))

    async def rank(request: web.Request) -> web.Response:
        arrived = router.clock()
        client_budget = parse_deadline_ms(request.headers.get(DEADLINE_HEADER))
        req = await parse_body(request, RankRequest)
        resp = await router.rank(await request.read(), req, client_budget)
        resp.headers[ROUTER_MS_HEADER] = f"{(router.clock() - arrived) * 1e3:.3f}"  # the harness's hop is the rest
        return resp

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


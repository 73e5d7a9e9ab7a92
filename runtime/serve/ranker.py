"""The ranker replica: holds the model and the prefix KV cache; serves prefill and rank over HTTP.

``POST /v1/prefill`` computes (or finds) the K/V of a user's long-term prefix and caches it;
``POST /v1/rank`` ranks candidates against the cached prefix when it is there (device or DRAM tier, or
a prefill for it is in flight: the rank joins that prefill and raises its priority, it never recomputes
the same prefix) and by full inference otherwise — a miss is never an error. When the user's cached
prefix (either tier) is an older version that is a prefix of the new one, both endpoints compute only the
new events against it (incremental prefill; a rank miss then caches the new version); ``reused_len`` in the
answers says how many tokens were reused, ``GET /v1/stats`` counts the tokens computed against those a
from-scratch prefill would have computed, and the compute-thread time by kind.

Overload: the compute queues are bounded (``max_queue`` ranks, ``max_prefill_queue`` prefills); a request
beyond the bound is answered 503 with ``Retry-After`` at once. A request may carry
``X-Grstack-Deadline-Ms`` (milliseconds left of its budget when sent; the router sets it): a rank that the
work queued ahead of it would push past that deadline (at the compute speed the ranker measures as it runs)
is answered 503 at once (``X-Grstack-Shed: predicted-late``), and work whose deadline passes anyway is
dropped before it is computed and answered 504 with the reason. A miss computed in chunks caches its prefix
for the user's next visits (``cache_misses``). ``GET /v1/profile`` returns the latency profile measured at
start-up (the router's trigger fits its latency model to it); ``/healthz`` is liveness, ``/readyz``
readiness (model loaded, warmed up, profiled), ``/metrics`` Prometheus, ``/openapi.json`` the API.
``GET /v1/steps?since=N&requests_since=M`` returns what service cost: every compute step (kind, sizes, seconds)
and each answered request's CPU outside the steps (parse, encode, reply), from bounded rings
(runtime/serve/step_log.py), which ``grstack bench serve --calibrate`` fits a cost profile to.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grstack.runtime.device import synchronize
from grstack.runtime.serve.backend import ComputeBackend
from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.clock import Clock, Now, SystemClock, thread_cpu, wait_for
from grstack.runtime.serve.dram_tier import DramTier
from grstack.runtime.serve.engine import PrefixKV, RankItem, RelayEngine, prefix_hash
from grstack.runtime.serve.eviction import recompute_seconds
from grstack.runtime.serve.gc_pauses import GcPauseMetric
from grstack.runtime.serve.host_pool import HostPool, evict_to_host
from grstack.runtime.serve.http import (
    DEADLINE_HEADER,
    MAX_BODY,
    RANKER_MS_HEADER,
    RequestError,
    error_response,
    json_errors,
    metrics_handler,
    model_response,
    openapi_document,
    openapi_handler,
    parse_deadline_ms,
    parse_json,
    route_template,
)
from grstack.runtime.serve.kv_arena import KVArena
from grstack.runtime.serve.placement import PlacementStore, Replica
from grstack.runtime.serve.prefix import context_key
from grstack.runtime.serve.scheduler import (
    ComputeRunner,
    ComputeScheduler,
    DeadlineExceeded,
    QueueFull,
    ThreadRunner,
    Timing,
)
from grstack.runtime.serve.schemas import (
    MAX_BODY_BYTES,
    CacheStatsModel,
    Events,
    Health,
    PrefillRequest,
    PrefillResponse,
    Profile,
    RankRequest,
    RankResponse,
    StepsResponse,
)
from grstack.runtime.serve.security import ServerSecurity, guard
from grstack.runtime.serve.service_cost import SERVICE_COST_STEPS, service_cost_factor
from grstack.runtime.serve.step_log import RequestCpu, StepLog
from grstack.runtime.serve.trigger import latest_model

if TYPE_CHECKING:
    from grstack.runtime.model import HSTU

log = logging.getLogger(__name__)
KV_ARENA_ENV = "GRSTACK_KV_ARENA"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class RankerConfig:
    replica_id: str | None = None  # default: the URL the ranker listens on
    device: str = "cpu"
    device_cache_bytes: int = 512 << 20
    dram_cache_bytes: int = 2 << 30
    dram_ttl_s: float = 600.0
    max_suffix: int = 64
    max_candidates: int = 1024
    max_batch: int = 32
    chunk: int = 256
    max_step_tokens: int | None = 1024  # new tokens of one batched prefill/miss step (bounds a rank's wait)
    prefill_wait_ms: float = 200.0  # unused: a rank joins an in-flight prefill (kept for old command lines)
    max_queue: int | None = 256  # queued rank requests; beyond it 503 + Retry-After (None: unbounded)
    max_prefill_queue: int | None = 1024  # queued prefills; beyond it 503 + Retry-After
    retry_after_s: float = 1.0
    # A rank with a deadline that the queued work ahead of it (at the compute speed measured online) would push
    # past ``deadline - admission_margin_ms`` is answered 503 at once (X-Grstack-Shed: predicted-late), not
    # queued to expire; the margin is the answer's way back to the caller. None: no prediction.
    admission_margin_ms: float | None = 5.0
    # A miss computed in chunks leaves its whole prefix's K/V: cache it, as a prefill would (automatic prefix
    # caching, as vLLM and SGLang keep every computed prefix), so the user's next visits rank against it.
    # A miss short enough for one full inference keeps no K/V. False: a miss's prefix is dropped.
    cache_misses: bool = True
    profile_candidates: int = 64
    profile_short: int = 16
    profile_cap_ms: float = 400.0
    max_body_bytes: int = MAX_BODY_BYTES
    lease_ttl_s: float = 5.0
    num_threads: int | None = 1  # torch intra-op threads on CPU (process-wide); None keeps torch's default
    # The device tier as one pre-allocated KV arena of device_cache_bytes (runtime/serve/kv_arena.py):
    # prefills write in place, rank batches read views (no per-batch concatenation). None: $GRSTACK_KV_ARENA
    # (1/0) if set, else on for CUDA only.
    kv_arena: bool | None = None
    kv_dtype: str | None = None  # the cached K/V's dtype: "fp32" | "bf16" | "fp16" (None: the model's, exact)
    # device-tier eviction: "lru", or "cost": the cheapest to recompute per byte and least recent first (the
    # start-up profile's prefill times; runtime/serve/eviction.py)
    eviction: str = "lru"
    step_log: int = 16384  # records each of the step and request rings keeps (GET /v1/steps)


class _Metrics:
    def __init__(self, service: RankerService) -> None:
        self.registry = r = CollectorRegistry()
        self.gc_pauses = GcPauseMetric(r, "grstack_ranker")
        self.requests = Counter("grstack_ranker_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram("grstack_ranker_rank_seconds", "rank latency inside the ranker", ["cache"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.lookups = Counter("grstack_ranker_cache_lookups", "prefix cache lookups by rank requests",
                               ["result"], registry=r)
        self.prefills = Counter("grstack_ranker_prefills", "prefill signals by outcome", ["status"], registry=r)
        self.prefill_tokens = Counter("grstack_ranker_prefill_tokens",
                                      "prefix tokens computed by prefill/extend (cache-miss prefixes included)",
                                      registry=r)
        self.prefill_tokens_full = Counter("grstack_ranker_prefill_tokens_without_incremental",
                                           "prefix tokens a from-scratch prefill would have computed", registry=r)
        self.compute_seconds = Counter("grstack_ranker_compute_seconds", "compute-thread time by kind", ["kind"],
                                       registry=r)
        self.queue_wait = Histogram("grstack_ranker_queue_wait_seconds",
                                    "time from enqueue to the start of compute", ["kind"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_seconds = Histogram("grstack_ranker_prefill_seconds", "prefill compute time",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.shed = Counter("grstack_ranker_shed", "requests refused or dropped under overload", ["reason"],
                            registry=r)
        self.unknown_values = Counter("grstack_ranker_unknown_user_feature_values",
                                      "request user-feature values the model never saw (read as no value)",
                                      registry=r)
        self.batch = Histogram("grstack_ranker_batch_size", "requests per compute step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        cache_bytes = Gauge("grstack_ranker_cache_bytes", "bytes held by the prefix cache", ["tier"], registry=r)
        cache_bytes.labels("device").set_function(lambda: service.cache.device_used)
        cache_bytes.labels("dram").set_function(lambda: service.cache.dram_used)
        entries = Gauge("grstack_ranker_cache_entries", "prefixes held", ["tier"], registry=r)
        entries.labels("device").set_function(lambda: service.cache.entries("device"))
        entries.labels("dram").set_function(lambda: service.cache.entries("dram"))
        arena = service.arena
        if arena is not None:
            tokens = Gauge("grstack_ranker_kv_arena_tokens", "KV arena tokens: capacity, used, largest free range",
                           ["state"], registry=r)
            tokens.labels("capacity").set_function(lambda: arena.capacity)
            tokens.labels("used").set_function(lambda: arena.used_tokens)
            tokens.labels("largest_free").set_function(arena.largest_free)
            moves = Gauge("grstack_ranker_kv_arena_compactions", "KV arena compactions so far", registry=r)
            moves.set_function(lambda: arena.compactions)
        depth = Gauge("grstack_ranker_queue_depth", "requests waiting for compute", ["queue"], registry=r)
        for q in ("hits", "misses", "prefills"):
            depth.labels(q).set_function(functools.partial(_queue_depth, service, q))


def _queue_depth(service: RankerService, queue: str) -> int:
    return service.scheduler.depth()[queue]


def _bits(names: Sequence[str]) -> str:
    return ", ".join(f"{n} = {1 << b}" for b, n in enumerate(names))


def _check_items(name: str, items: Sequence[int] | np.ndarray, num_items: int) -> None:
    if len(items) and int(np.max(items)) > num_items:  # a list (parsed JSON) or an array (a simulator's request)
        i = next(i for i, x in enumerate(items) if x > num_items)
        raise RequestError(422, f"{name}[{i}]: item id {items[i]} is beyond the model's catalogue "
                                f"(1..{num_items})")


class RankerService:
    """``user_vocab`` (field -> raw tokens of value ids 1, 2, ...: the artefact's, as :func:`load_serving_model` returns it)
    maps request user features for a model with user context; ``action_names`` names a model's action-input
    bits (default: the tasks after "next")."""

    def __init__(self, model: HSTU, tasks: list[str], config: RankerConfig | None = None,
                 store: PlacementStore | None = None, user_vocab: dict[str, list[str]] | None = None,
                 action_names: Sequence[str] | None = None, clock: Clock | None = None,
                 backend: ComputeBackend | None = None, cpu: Now = thread_cpu, dram: DramTier | None = None,
                 runner: ComputeRunner | None = None,
                 promote: Callable[[PrefixKV], Awaitable[PrefixKV]] | None = None,
                 to_host: Callable[[PrefixKV], PrefixKV] | None = None) -> None:
        """``clock``: the time of TTLs, deadlines and latencies (the system's when None); ``backend``: the tensor
        math the scheduler and the profiler call (the engine when None; a stand-in keeps everything else real);
        ``cpu``: what a request's CPU segments are read from (the event loop thread's CPU time); ``dram``: the
        server's DRAM tier shared with the other replicas in this process (None: this replica's own, of
        ``config.dram_cache_bytes`` and ``config.dram_ttl_s``); ``runner``: where the scheduler's compute runs (its
        own thread when None); ``promote``/``to_host``: how a prefix moves from DRAM to the device and back (the
        device's copies when None; a simulated replica charges the transfer time instead)."""
        self.config = cfg = config or RankerConfig()
        if cfg.eviction not in ("lru", "cost"):
            raise ValueError(f"eviction must be 'lru' or 'cost', got {cfg.eviction!r}")
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.cpu = cpu
        self.steps = StepLog(cfg.step_log)
        self.tasks = list(tasks)
        self.num_items = int(model.num_items)
        device = torch.device(cfg.device)
        if device.type == "cpu" and cfg.num_threads:
            # One replica per core: more threads than cores makes small ops spin (10-100x slower under load).
            torch.set_num_threads(cfg.num_threads)
        self.engine = RelayEngine(model, device=device, max_suffix=cfg.max_suffix, chunk=cfg.chunk,
                                  kv_dtype=cfg.kv_dtype)
        self.backend: ComputeBackend = backend if backend is not None else self.engine
        bits = self.engine.action_bits
        names = list(action_names) if action_names is not None else [t for t in tasks if t != "next"]
        if bits and len(names) != bits:
            raise ValueError(f"the model reads {bits} action bits; {len(names)} action names were given ({names})")
        self.action_names = names if bits else []
        context = model.context
        self.user_fields: list[str] = list(context.sizes) if context is not None else []
        self._vocab: dict[str, dict[str, int]] = {}
        if context is not None and self.user_fields:
            if user_vocab is None:
                raise ValueError("the model reads user context: its user features' vocabularies are needed "
                                 "(load_serving_model returns the artefact's)")
            for f in self.user_fields:
                tokens = user_vocab.get(f)
                if tokens is None or len(tokens) != context.sizes[f]:
                    raise ValueError(f"user feature {f!r}: the vocabulary does not match the model's "
                                     f"{context.sizes[f]} values")
                self._vocab[f] = {str(t): i + 1 for i, t in enumerate(tokens)}
        # On CUDA an eviction's device-to-host copy runs on a side stream, so the event loop never blocks on it.
        copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Evicted prefixes are copied into a bounded, reused host pool (pinned on CUDA): no allocation per eviction.
        dram_budget = dram.capacity_bytes if dram is not None else cfg.dram_cache_bytes
        self.host_pool = HostPool(dram_budget + dram_budget // 4, device=device)
        to_host = to_host if to_host is not None else evict_to_host(self.host_pool, copy_stream)
        use_arena = cfg.kv_arena
        if use_arena is None:  # GRSTACK_KV_ARENA=1/0 overrides the by-device default (operators, tests)
            env = os.environ.get(KV_ARENA_ENV)
            use_arena = env.strip().lower() not in ("0", "false", "no", "") if env is not None else device.type == "cuda"
        self.arena = (KVArena.from_budget(self.engine.model, cfg.device_cache_bytes, backend=self.engine.backend,
                                          kv_dtype=self.engine.kv_dtype) if use_arena else None)
        self.cache = TieredKVCache(cfg.device_cache_bytes, cfg.dram_cache_bytes, cfg.dram_ttl_s, to_host=to_host,
                                   to_device=promote if promote is not None
                                   else self._to_device if device.type != "cpu" else None, arena=self.arena,
                                   head=self.engine.head, clock=self.clock, dram=dram,
                                   evict_cost_s=recompute_seconds(lambda: self.profile)
                                   if cfg.eviction == "cost" else None)
        self.metrics = _Metrics(self)
        self.scheduler = ComputeScheduler(self.backend, max_batch=cfg.max_batch, clock=self.clock,
                                          on_batch=self.metrics.batch.observe, max_queue=cfg.max_queue,
                                          max_prefill_queue=cfg.max_prefill_queue,
                                          retry_after_s=cfg.retry_after_s, max_step_tokens=cfg.max_step_tokens,
                                          on_tokens=self._on_tokens, on_compute=self._on_compute,
                                          reserve=self.cache.reserve if self.arena is not None else None,
                                          steps=self.steps,
                                          runner=runner if runner is not None else ThreadRunner(),
                                          admission_margin_s=None if cfg.admission_margin_ms is None
                                          else cfg.admission_margin_ms / 1e3)
        self.store = store
        self.replica_id = cfg.replica_id or ""
        self.url = ""
        self.profile: Profile | None = None
        self._latency = latest_model(lambda: self.profile)  # the profile's curves, for the cost factor
        self.ready = False
        self._inflight: dict[tuple[str, str], asyncio.Task[tuple[PrefixKV, float, int]]] = {}
        self._inflight_jobs: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._prefills_computed = 0
        self._ranks = 0
        self._joined = 0

    def _on_tokens(self, computed: int, without: int) -> None:
        self.metrics.prefill_tokens.inc(computed)
        self.metrics.prefill_tokens_full.inc(without)

    def _on_compute(self, kind: str, seconds: float) -> None:
        self.metrics.compute_seconds.labels(kind).inc(seconds)

    # -- request inputs beyond items and times -----------------------------------------------------
    def _event_actions(self, name: str, events: Events) -> np.ndarray | None:
        """The events' action bits for a model that reads them (None otherwise: a client may send them to
        any model); a missing list or a bit the model does not know is a 422 naming it."""
        bits = self.engine.action_bits
        if not bits:
            return None
        if events.actions is None:
            if not events.items:
                return np.zeros(0, dtype=np.int64)
            raise RequestError(422, f"{name}.actions: this model reads each event's actions (bits: "
                                    f"{_bits(self.action_names)}); the request has none")
        a = np.asarray(events.actions, dtype=np.int64)
        beyond = np.flatnonzero(a >> bits)
        if len(beyond):
            i = int(beyond[0])
            raise RequestError(422, f"{name}.actions[{i}]: {a[i]} sets a bit beyond this model's actions "
                                    f"({_bits(self.action_names)})")
        return a

    def _user_context(self, user_features: dict[str, list[str]] | None) -> tuple[np.ndarray | None, bytes | None]:
        """([C, W] value ids, the prefix-version key) for a model with user context; (None, None) otherwise. A
        field the model does not read is a 422; a value it never saw counts as no value (as in training, where
        a user without a value has none)."""
        if not self.user_fields:
            return None, None
        given = user_features or {}
        unknown = sorted(set(given) - set(self.user_fields))
        if unknown:
            raise RequestError(422, f"user_features: {unknown[0]!r} is not a field this model reads "
                                    f"({', '.join(self.user_fields)})")
        rows = []
        for f in self.user_fields:
            ids = {self._vocab[f].get(v, 0) for v in given.get(f, [])}
            self.metrics.unknown_values.inc(sum(1 for v in given.get(f, []) if v not in self._vocab[f]))
            rows.append(sorted(ids - {0}))
        ctx = np.zeros((len(rows), max([1] + [len(r) for r in rows])), dtype=np.int64)
        for c, r in enumerate(rows):
            ctx[c, :len(r)] = r
        return ctx, context_key(given, self.user_fields)

    async def _base(self, user: str, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
                    context: bytes | None = None) -> PrefixKV | None:
        """The user's cached older prefix when it is a prefix of ``items``/``ts`` (promoted to the device if it
        was in DRAM), for an incremental prefill; None otherwise. Not a rank lookup: no hit/miss counted."""
        old = self.cache.extendable(user, items, ts, actions, context)
        if old is None:
            return None
        kv, _ = await self.cache.lookup(user, old, count=False)
        return kv

    async def _to_device(self, kv: PrefixKV) -> PrefixKV:
        return await self.scheduler.run_sync(lambda: kv.to(self.engine.device, non_blocking=True))

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self, url: str) -> None:
        self.url = url
        self.replica_id = self.replica_id or url
        self.scheduler.start()
        self.profile = await self.scheduler.run_sync(self._measure_profile)
        self.ready = True
        if self.store is not None:
            await self.store.register(Replica(self.replica_id, url), self.config.lease_ttl_s)
        log.info("ranker %s ready (%s)", self.replica_id, url)

    async def stop(self) -> None:
        self.ready = False
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.unregister(self.replica_id)
            await self.store.close()
        for task in self._inflight.values():
            task.cancel()
        await self.scheduler.stop()
        self.metrics.gc_pauses.close()

    # -- profile ------------------------------------------------------------------------------------
    def _synthetic(self, prefix_len: int, rng: np.random.Generator) -> RankItem:
        cfg = self.config
        s = min(cfg.profile_short, self.engine.max_suffix)
        n = prefix_len + s
        items = rng.integers(1, self.num_items + 1, n)
        ts = 1_600_000_000 + np.cumsum(rng.integers(1, 3600, n))
        acts = rng.integers(0, 1 << self.engine.action_bits, n) if self.engine.action_bits else None
        cands = rng.integers(1, self.num_items + 1, min(cfg.profile_candidates, cfg.max_candidates))
        return self.engine.canonical(items[:prefix_len], ts[:prefix_len], items[prefix_len:], ts[prefix_len:],
                                     cands, int(ts[-1]) + 1, acts[:prefix_len] if acts is not None else None,
                                     acts[prefix_len:] if acts is not None else None)

    def _measure_profile(self) -> Profile:
        """Times full ranking, prefill and cached ranking at doubling prefix lengths (warms up too)."""
        eng, cfg = self.engine, self.config
        rng = np.random.default_rng(0)
        lengths = []
        length = min(32, eng.max_prefix)
        while True:
            lengths.append(length)
            if length >= eng.max_prefix:
                break
            length = min(2 * length, eng.max_prefix)
        def timed(fn: Any) -> tuple[float, Any, float]:
            t0 = self.clock()
            out = fn()
            synchronize(eng.device)  # accelerators run asynchronously
            return t0, out, self.clock()

        math = self.backend  # what the scheduler will run: the profile is of it
        math.rank_full([self._synthetic(lengths[0], rng)])  # warm-up
        out_l, full, cached, prefill = [], [], [], []
        for length in lengths:
            item = self._synthetic(length, rng)
            reps: dict[str, list[float]] = {"full": [], "prefill": [], "cached": []}
            for _ in range(3):  # medians: one stall of a shared machine must not skew the model
                t0, _, t1 = timed(lambda item=item: math.rank_full([item]))
                t2, kv, t3 = timed(lambda item=item: math.prefill_tokens(math.item_tokens(item)))
                t4, _, t5 = timed(lambda kv=kv, item=item: math.rank_cached([kv], [item]))
                reps["full"].append(t1 - t0)
                reps["prefill"].append(t3 - t2)
                reps["cached"].append(t5 - t4)
            out_l.append(length)
            full.append(float(np.median(reps["full"])) * 1e3)
            prefill.append(float(np.median(reps["prefill"])) * 1e3)
            cached.append(float(np.median(reps["cached"])) * 1e3)
            if full[-1] > cfg.profile_cap_ms:
                break
        return Profile(replica=self.replica_id, max_len=eng.max_len, max_suffix=eng.max_suffix,
                       max_candidates=cfg.max_candidates, candidates=cfg.profile_candidates, lengths=out_l,
                       full_ms=full, cached_ms=cached, prefill_ms=prefill,
                       kv_bytes_per_token=math.kv_bytes_per_token, tasks=self.tasks, num_items=self.num_items,
                       action_names=self.action_names, user_fields=self.user_fields)

    # -- prefill ------------------------------------------------------------------------------------
    async def _compute_prefix(self, user: str, version: str, items: np.ndarray, ts: np.ndarray,
                              actions: np.ndarray | None, context: np.ndarray | None,
                              context_key: bytes | None) -> tuple[PrefixKV, float, int]:
        key = (user, version)
        base = await self._base(user, items, ts, actions, context_key)
        fut = self.scheduler.submit_prefill(None, None, base,
                                            prefix=self.engine.prefix_tokens(items, ts, actions, context))
        self._inflight_jobs[key] = fut
        try:
            kv, timing = await fut
        finally:
            self._inflight_jobs.pop(key, None)
        self.metrics.queue_wait.labels("prefill").observe(timing.queue_ms / 1e3)
        self.metrics.prefill_seconds.observe(timing.compute_ms / 1e3)
        self.cache.put(user, version, kv)
        self._prefills_computed += 1
        return kv, timing.compute_ms, 0 if base is None else base.length - self.engine.head

    async def prefill(self, req: PrefillRequest, cpu: RequestCpu | None = None) -> PrefillResponse:
        """``cpu``: where the request's encode and reply CPU are added (the handler logs them)."""
        cpu = cpu if cpu is not None else RequestCpu()
        c0 = self.cpu()
        _check_items("long_term.items", req.long_term.items, self.num_items)
        actions = self._event_actions("long_term", req.long_term)
        context, ckey = self._user_context(req.user_features)
        items, ts = self.engine.truncate_prefix(req.long_term.items, req.long_term.timestamps)
        actions = self.engine.truncate_actions(actions, len(req.long_term.items))
        version = prefix_hash(items, ts, actions, ckey)
        user = req.user_id
        key = (user, version)
        compute_ms, reused = 0.0, 0
        cpu.encode_s += self.cpu() - c0
        kv: PrefixKV | None = None
        if self.cache.tier_of(user, version) is not None:
            kv, tier = await self.cache.lookup(user, version, count=False)  # a signal is not a cache hit
            status = "cached" if tier == "device" else "promoted"
        if kv is None:
            task = self._inflight.get(key)
            status = "joined"
            if task is None:
                status = "computed"
                task = asyncio.get_running_loop().create_task(
                    self._compute_prefix(user, version, items, ts, actions, context, ckey))
                self._inflight[key] = task
                task.add_done_callback(lambda _t: self._inflight.pop(key, None))
                await asyncio.sleep(0)  # let it submit: a full prefill queue is answered now (503)
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            computed, compute_ms, reused = await asyncio.shield(task)
            kv = computed
        self.metrics.prefills.labels(status).inc()
        c1 = self.cpu()
        out = PrefillResponse(user_id=user, replica=self.replica_id, prefix_hash=version, prefix_len=len(items),
                              status=status, kv_bytes=kv.nbytes, compute_ms=compute_ms, reused_len=reused)
        cpu.reply_s += self.cpu() - c1
        return out

    # -- rank ---------------------------------------------------------------------------------------
    async def rank(self, req: RankRequest, deadline: float | None = None,
                   cpu: RequestCpu | None = None) -> RankResponse:
        """``deadline``: the scheduler clock's time by which the answer is due (None: no deadline); ``cpu``: where
        the request's encode and reply CPU are added (the handler logs them)."""
        cpu = cpu if cpu is not None else RequestCpu()
        c0 = self.cpu()
        if len(req.candidates) > self.config.max_candidates:
            raise RequestError(422, f"candidates: {len(req.candidates)} candidates, this ranker accepts at most "
                                    f"{self.config.max_candidates}")
        for name, items in (("long_term.items", req.long_term.items), ("short_term.items", req.short_term.items),
                            ("candidates", req.candidates)):
            _check_items(name, items, self.num_items)
        t0 = self.clock()
        eng = self.engine
        context, ckey = self._user_context(req.user_features)
        item = eng.canonical(req.long_term.items, req.long_term.timestamps, req.short_term.items,
                             req.short_term.timestamps, req.candidates, req.request_ts(),
                             self._event_actions("long_term", req.long_term),
                             self._event_actions("short_term", req.short_term), context)
        truncated = (len(req.long_term.items) - len(item.long_items)
                     + len(req.short_term.items) - len(item.short_items))
        version = prefix_hash(item.long_items, item.long_ts, item.long_actions, ckey)
        cpu.encode_s += self.cpu() - c0
        kv, tier, joined, joined_ms = None, None, False, 0.0
        if len(item.long_items):
            kv, tier = await self.cache.lookup(req.user_id, version)
            key = (req.user_id, version)
            task = self._inflight.get(key) if kv is None else None
            if task is not None:
                # Join the in-flight prefill (never recompute the same prefix) and raise its priority.
                job = self._inflight_jobs.get(key)
                if job is not None:
                    self.scheduler.check_join(job, deadline)
                    self.scheduler.boost(job)
                timeout = None if deadline is None else max(0.0, deadline - self.scheduler.clock())
                waited = self.clock()
                try:
                    kv, _, _ = await wait_for(self.clock, asyncio.shield(task), timeout)
                except TimeoutError:
                    self.metrics.shed.labels("deadline").inc()
                    raise DeadlineExceeded("deadline passed while waiting for the in-flight prefill") from None
                except Exception:  # the prefill failed: rank by full inference
                    kv = None
                tier = "device" if kv is not None else None
                joined = kv is not None
                joined_ms = (self.clock() - waited) * 1e3
        if kv is not None and not kv.live:  # evicted after its prefill and its arena range freed: a miss
            kv, tier, joined = None, None, False
        self.metrics.lookups.labels("joined" if joined else (tier or "miss")).inc()
        self._joined += joined
        timing: Timing
        base = None if kv is not None or not len(item.long_items) else await self._base(
            req.user_id, item.long_items, item.long_ts, item.long_actions, ckey)
        if kv is not None:
            logits, timing = await self.scheduler.rank_cached(kv, item, deadline)
        elif base is not None:
            # An older prefix of this one is cached: extend it by the new events, rank, keep the new version.
            logits, new_kv, timing = await self.scheduler.rank_extend(item, base, deadline)
            if new_kv is not None:
                self.cache.put(req.user_id, version, new_kv)
        elif self.config.cache_misses and len(item.long_items):
            logits, new_kv, timing = await self.scheduler.rank_full_cached(item, deadline)
            if new_kv is not None:
                self.cache.put(req.user_id, version, new_kv)
        else:
            logits, timing = await self.scheduler.rank_full(item, deadline)
        self.metrics.queue_wait.labels("hit" if kv is not None else "miss").observe(timing.queue_ms / 1e3)
        self._ranks += 1
        cache = tier or "miss"
        self.metrics.latency.labels(cache).observe(self.clock() - t0)
        c1 = self.cpu()
        out = RankResponse(user_id=req.user_id, replica=self.replica_id, tasks=self.tasks,
                           scores=logits.cpu().tolist(), cache=cache, prefix_hash=version,
                           prefix_len=len(item.long_items), short_len=len(item.short_items), truncated=truncated,
                           queue_ms=timing.queue_ms, compute_ms=timing.compute_ms,
                           reused_len=0 if base is None else base.length - eng.head, joined_ms=joined_ms)
        cpu.reply_s += self.cpu() - c1
        return out

    def log_request(self, arrived: float, req: PrefillRequest | RankRequest, cpu: RequestCpu) -> str:
        """Logs an answered request's CPU; returns its time since ``arrived`` (scheduler clock) for the
        :data:`RANKER_MS_HEADER` of its answer."""
        if isinstance(req, RankRequest):
            endpoint, events, cands = "rank", len(req.long_term.items) + len(req.short_term.items), len(req.candidates)
        else:
            endpoint, events, cands = "prefill", len(req.long_term.items), 0
        self.steps.request(arrived, endpoint, events, cands, cpu)
        return f"{(self.scheduler.clock() - arrived) * 1e3:.3f}"

    def steps_since(self, since: int = 0, requests_since: int = 0) -> StepsResponse:
        """The step and request records numbered above ``since`` / ``requests_since`` (``GET /v1/steps``)."""
        steps, sdrop = self.steps.steps.since(since)
        reqs, rdrop = self.steps.requests.since(requests_since)
        return StepsResponse.model_validate(
            {"replica": self.replica_id, "capacity": self.steps.steps.capacity,
             "steps": [{"seq": r.seq, "t": r.t, "kind": r.kind, "batch": r.batch, "tokens": r.tokens,
                        "context": r.context, "pairs": r.pairs, "seconds": r.seconds,
                        "cpu_seconds": r.cpu_seconds, "cold": r.cold} for r in steps],
             "steps_dropped": sdrop,
             "requests": [{"seq": r.seq, "t": r.t, "endpoint": r.endpoint, "events": r.events,
                           "candidates": r.candidates, "parse_s": r.parse_s, "encode_s": r.encode_s,
                           "reply_s": r.reply_s} for r in reqs],
             "requests_dropped": rdrop,
             "next_since": max(since, self.steps.steps.appended),
             "next_requests_since": max(requests_since, self.steps.requests.appended)})

    def stats(self) -> CacheStatsModel:
        s = self.cache.stats
        return CacheStatsModel(replica=self.replica_id, device_hits=s.device_hits, dram_hits=s.dram_hits,
                               misses=s.misses, promotions=s.promotions, device_bytes=self.cache.device_used,
                               dram_bytes=self.cache.dram_used, device_entries=self.cache.entries("device"),
                               dram_entries=self.cache.entries("dram"),
                               prefills_computed=self._prefills_computed, ranks=self._ranks,
                               queued=sum(self.scheduler.depth().values()),
                               device_capacity_bytes=self.cache.device_bytes,
                               dram_capacity_bytes=self.cache.dram_bytes, queue_depth=self.scheduler.depth(),
                               prefill_backlog_tokens=self.scheduler.backlog_tokens(),
                               compute_ms_total={k: v * 1e3 for k, v in self.scheduler.compute_s.items()},
                               prefill_tokens_computed=self.scheduler.tokens_computed,
                               prefill_tokens_without_incremental=self.scheduler.tokens_without_incremental,
                               incremental_prefills=self.scheduler.incremental_prefills,
                               joined_ranks=self._joined, service_cost_factor=self.service_cost_factor())

    def service_cost_factor(self) -> float | None:
        """In-service over profiled cost of the recent steps (runtime/serve/service_cost.py)."""
        model = self._latency()
        if model is None:
            return None
        suffix = min(self.config.profile_short, self.engine.max_suffix) + min(self.config.profile_candidates,
                                                                             self.config.max_candidates)
        return service_cost_factor(self.steps.steps.last(SERVICE_COST_STEPS), model, suffix)


# -- HTTP ---------------------------------------------------------------------------------------------
ROUTES: list[dict[str, Any]] = [
    {"method": "POST", "path": "/v1/prefill", "summary": "pre-infer a user's long-term prefix and cache its K/V",
     "request": PrefillRequest, "responses": {200: PrefillResponse}},
    {"method": "POST", "path": "/v1/rank", "summary": "score candidates (cached prefix, else full inference)",
     "request": RankRequest, "responses": {200: RankResponse}},
    {"method": "GET", "path": "/v1/profile", "summary": "latency profile measured at start-up",
     "responses": {200: Profile, 503: Health}},
    {"method": "GET", "path": "/v1/stats", "summary": "prefix cache counters", "responses": {200: CacheStatsModel}},
    {"method": "GET", "path": "/v1/steps", "summary": "compute steps and request CPU logged in service "
     "(query: since, requests_since)", "responses": {200: StepsResponse}},
    {"method": "GET", "path": "/healthz", "summary": "liveness", "responses": {200: Health}},
    {"method": "GET", "path": "/readyz", "summary": "readiness: warmed up and profiled",
     "responses": {200: Health, 503: Health}},
    {"method": "GET", "path": "/metrics", "summary": "Prometheus metrics", "responses": {200: None}},
]


def make_ranker_app(service: RankerService, security: ServerSecurity | None = None) -> web.Application:
    """``security``: the tokens, client certificates, open paths and body timeout its guard enforces."""
    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        service.metrics.requests.labels(route_template(request), str(resp.status)).inc()
        return resp

    @web.middleware
    async def overload(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except QueueFull as exc:
            service.metrics.shed.labels(exc.reason).inc()
            retry = max(1, round(exc.retry_after_s))
            return error_response(503, f"overloaded: {exc}; retry after {retry} s",
                                  headers={"Retry-After": str(retry), "X-Grstack-Shed": exc.reason})
        except DeadlineExceeded as exc:
            service.metrics.shed.labels("deadline").inc()
            return error_response(504, f"deadline exceeded: {exc}", headers={"X-Grstack-Shed": "deadline"})

    app = web.Application(client_max_size=service.config.max_body_bytes,
                          middlewares=[count, json_errors, guard(security or ServerSecurity()), overload])
    app[MAX_BODY] = service.config.max_body_bytes

    def answered(arrived: float, req: PrefillRequest | RankRequest, cpu: RequestCpu,
                 model: PrefillResponse | RankResponse) -> web.Response:
        c0 = service.cpu()
        resp = model_response(model)
        cpu.reply_s += service.cpu() - c0
        resp.headers[RANKER_MS_HEADER] = service.log_request(arrived, req, cpu)
        return resp

    async def prefill(request: web.Request) -> web.Response:
        arrived = service.scheduler.clock()
        if not service.ready:
            raise RequestError(503, "ranker is starting")
        body = await request.read()  # raises 413 over client_max_size
        cpu = RequestCpu()
        c0 = service.cpu()
        req = parse_json(body, PrefillRequest)
        cpu.parse_s = service.cpu() - c0
        return answered(arrived, req, cpu, await service.prefill(req, cpu))

    async def rank(request: web.Request) -> web.Response:
        arrived = service.scheduler.clock()
        if not service.ready:
            raise RequestError(503, "ranker is starting")
        budget_ms = parse_deadline_ms(request.headers.get(DEADLINE_HEADER))
        deadline = None if budget_ms is None else arrived + budget_ms / 1e3
        body = await request.read()
        cpu = RequestCpu()
        c0 = service.cpu()
        req = parse_json(body, RankRequest)
        cpu.parse_s = service.cpu() - c0
        if deadline is not None and service.scheduler.clock() >= deadline:
            service.metrics.shed.labels("deadline").inc()
            raise DeadlineExceeded("deadline passed on arrival; dropped before compute")
        return answered(arrived, req, cpu, await service.rank(req, deadline, cpu))

    async def steps(request: web.Request) -> web.Response:
        def count(name: str) -> int:
            try:
                value = int(request.query.get(name, "0"))
            except ValueError:
                raise RequestError(422, f"{name}: expected a record number, got {request.query[name]!r}") from None
            if value < 0:
                raise RequestError(422, f"{name}: a record number is not negative ({value})")
            return value

        return model_response(service.steps_since(count("since"), count("requests_since")))

    async def profile(_: web.Request) -> web.Response:
        if service.profile is None:
            return model_response(Health(status="starting"), 503)
        return model_response(service.profile)

    async def stats(_: web.Request) -> web.Response:
        return model_response(service.stats())

    async def healthz(_: web.Request) -> web.Response:
        return model_response(Health(status="ok", detail={"replica": service.replica_id}))

    async def readyz(_: web.Request) -> web.Response:
        if not service.ready:
            return model_response(Health(status="starting", detail={"replica": service.replica_id}), 503)
        return model_response(Health(status="ok", detail={"replica": service.replica_id}))

    app.router.add_post("/v1/prefill", prefill)
    app.router.add_post("/v1/rank", rank)
    app.router.add_get("/v1/profile", profile)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/steps", steps)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler(service.metrics.registry))
    app.router.add_get("/openapi.json", openapi_handler(openapi_document("grstack ranker", "v1", ROUTES)))
    return app


async def start_ranker(service: RankerService, host: str = "127.0.0.1", port: int = 0,
                       security: ServerSecurity | None = None) -> tuple[web.AppRunner, str]:
    """Binds, then warms up and profiles (``/readyz`` turns 200 when done). Returns the runner and URL."""
    from grstack.runtime.serve.http import start_site

    app = make_ranker_app(service, security)

    async def _stop(_: web.Application) -> None:
        await service.stop()

    app.on_cleanup.append(_stop)
    runner, url = await start_site(app, host, port, security)
    await service.start(url)
    return runner, url

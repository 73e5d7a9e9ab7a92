"""One point of ``grstack bench serve`` on virtual time: the real control plane, the tensor math replaced by costs.

A :class:`SimulatedDeployment` is what the real benchmark starts for a mode — rankers configured by the very
command line the benchmark gives them (``serve.ranker_args`` through the ranker CLI's own parser) and the router
of ``serve.router_config`` — built in this process on a :class:`~grstack.runtime.serve.virtual_time.VirtualTimeLoop`:

* every ranker is a real :class:`~grstack.runtime.serve.ranker.RankerService` (scheduler, tiered cache, in-flight
  joins, admission) whose backend is :class:`~grstack.runtime.serve.backend_cost.CostBackend`, whose compute
  runs on a :class:`~grstack.runtime.serve.virtual_time.CoreSet` of ``cores_per_replica`` cores, whose DRAM tier is
  its server's (one :class:`~grstack.runtime.serve.dram_tier.DramTier` shared by the server's replicas) and whose
  promotions take the profile's host-to-device transfer time;
* the router is a real :class:`~grstack.runtime.serve.router.Router` reaching its rankers through
  :class:`SimulatedTransport` (in process; the link hop and the ranker's request CPU — parse, encode, reply, on
  the replica's cores — drawn from the profile);
* the load generator replays the benchmark's own trace (``serve.encode``) open loop, adds the harness and router
  hops, and yields the same :class:`~grstack.runtime.serve.loadgen.Result` objects the real one does, so a point is
  summarised by the real benchmark's ``summarize``.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import generate_latest

from grstack.runtime.bench import serve as real
from grstack.runtime.bench.serve_trace import Trace
from grstack.runtime.serve import (
    CoreSet,
    CostModel,
    CostProfile,
    InProcessTransport,
    SharedCores,
    VirtualClock,
    VirtualComputeRunner,
)

MB = 1 << 20
ROUTER_SETTLE_POLLS = 2.5  # load poll intervals a simulated router runs idle before its point's first request
_TRIGGER_LINE = re.compile(r'^grstack_router_trigger_total\{reason="([^"]+)"\} (\S+)$', re.MULTILINE)


@dataclass(frozen=True)
class Deployment:
    """What is simulated: ``replicas`` rankers on ``servers`` servers (replicas split evenly), each replica with
    ``cores_per_replica`` cores for its compute and its request handling and ``device_cache_mb`` of device tier;
    each server one DRAM tier of ``dram_mb_per_server`` shared by its replicas (RelayGR's server-local DRAM)."""

    replicas: int = real.RANKERS
    servers: int = 1
    cores_per_replica: int = 1
    device_cache_mb: float = real.DEVICE_CACHE_MB
    dram_mb_per_server: float = real.DRAM_CACHE_MB * real.RANKERS
    dram_ttl_s: float = real.DRAM_TTL_S
    shared_cores: bool = False  # the cores shared as the kernel does (SharedCores), not held first come first served
    # the tensor math runs on an accelerator of the replica's own (a GPU), not on the cores that handle its
    # requests: a step then never waits for a request's parse, nor a parse for a step (a CPU host: both one core)
    accelerator: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.servers < 1 or self.servers > self.replicas or self.cores_per_replica < 1:
            raise ValueError(f"a deployment needs 1 <= servers <= replicas and a core per replica: {self}")

    def server_of(self, replica: int) -> int:
        return replica * self.servers // self.replicas


def ranker_config(mode: str, dep: Deployment, max_len: int) -> Any:
    """The ranker's configuration for ``mode``: the benchmark's command line through the ranker CLI's parser,
    with the deployment's device tier (the DRAM tier is the server's, built by the deployment)."""
    from grstack.runtime.serve import ranker_config_from_flags

    flags = [*real.ranker_args(mode), "--device-cache-mb", f"{dep.device_cache_mb!r}", "--dram-ttl-s",
             f"{dep.dram_ttl_s!r}"]  # the later flag wins
    cfg = ranker_config_from_flags(flags, max_len)
    cfg.num_threads = None  # torch runs nothing that matters here; keep the process's setting
    cfg.kv_arena = False  # the device tier's byte budget is the simulated one; no storage is allocated
    return cfg


def startup_profile(own: Any, measured: list[dict[str, Any]], mode: str, index: int) -> Any:
    """``own`` (the simulated ranker's start-up profile) with the latency curves a calibrated real ranker measured
    at start-up: the ``index``-th of ``mode``'s (or of all when the calibration ran no ranker of ``mode``), cut to
    ``own``'s longest length and interpolated there. Everything else (replica, sizes, tasks) stays ``own``'s."""
    pool = [m for m in measured if m.get("mode") == mode] or measured
    m = pool[index % len(pool)]
    xs = [int(n) for n in m["lengths"]]
    top = own.lengths[-1]
    keep = [k for k, n in enumerate(xs) if n < top]
    lengths = [xs[k] for k in keep] + ([top] if top <= xs[-1] else [])  # past the last: the cap ended it there
    curves = {key: [float(m[key][k]) for k in keep]
              + ([float(np.interp(top, xs, m[key]))] if top <= xs[-1] else [])
              for key in ("full_ms", "cached_ms", "prefill_ms")}
    return own.model_copy(update={"lengths": lengths, **curves})


def _uses_dram(mode: str) -> bool:
    return mode not in ("no_expander", "prefix_cache")


class SimulatedTransport(InProcessTransport):
    """:class:`InProcessTransport` plus what HTTP costs: the link hop (half each way) as a delay, and the ranker's
    request CPU (parse and encode before, reply after) held on the replica's cores. A request's sizes come from
    ``sizes`` (its body -> events, candidates), which the load generator fills."""

    def __init__(self, costs: HostCosts, cores: Mapping[str, CoreSet], clock: VirtualClock) -> None:
        super().__init__(clock=clock)
        self.costs = costs
        self.cores = dict(cores)
        self.sizes: dict[bytes, tuple[int, int]] = {}
        self.requests: dict[bytes, Any] = {}  # body -> the request it stands for (built by the load generator)

    def parse(self, body: bytes, model: type[Any]) -> Any:
        """The request a simulated body stands for: its JSON is never written, so its parse costs nothing here
        (the parse CPU is drawn from the profile instead); any other body is parsed as the HTTP app does."""
        req = self.requests.get(body)
        return req if isinstance(req, model) else super().parse(body, model)

    async def post(self, url: str, path: str, body: bytes, timeout_s: float,
                   headers: Mapping[str, str] | None = None) -> Any:
        endpoint = "rank" if path == "/v1/rank" else "prefill"
        events, cands = self.sizes.get(body, (0, 0))
        link = self.costs.hop("link")
        await asyncio.sleep(link / 2)
        await self._on_loop(url, self.costs.request(endpoint, "parse", events, cands)
                            + self.costs.request(endpoint, "encode", events, cands))
        reply = await super().post(url, path, body, timeout_s, headers)
        await self._on_loop(url, self.costs.request(endpoint, "reply", events, cands))
        await asyncio.sleep(link / 2)
        return reply

    async def _on_loop(self, url: str, seconds: float) -> None:
        """``seconds`` of the ranker's event-loop thread (one request's phase at a time) on its replica's cores."""
        cores = self.cores.get(url)
        if cores is not None:
            await cores.spend(seconds, thread="event loop")


class HostCosts:
    """Draws of the profile's host work: request CPU by ``endpoint.phase`` and hops by name (0 when the profile
    has none: a paper-scale profile without a calibrated host). ``tails``: draw from the residual distribution;
    else the fitted prediction."""

    def __init__(self, profile: CostProfile, rng: np.random.Generator, tails: bool = True) -> None:
        self.profile = profile
        self.rng = rng
        self.tails = tails

    def _draw(self, m: CostModel | None, sizes: Mapping[str, float]) -> float:
        if m is None:
            return 0.0
        return m.draw(float(self.rng.random()), sizes) if self.tails else max(0.0, m.predict(sizes))

    def request(self, endpoint: str, phase: str, events: int, candidates: int) -> float:
        return self._draw(self.profile.requests.get(f"{endpoint}.{phase}"),
                          {"events": events, "candidates": candidates})

    def hop(self, name: str) -> float:
        return self._draw(self.profile.hops.get(name), {})


class SimulatedDeployment:
    """One mode's rankers and router on the running virtual-time loop (start, serve a point, stop)."""

    def __init__(self, mode: str, dep: Deployment, profile: CostProfile, model: Any, tasks: list[str],
                 slo_ms: float, max_len: int, seed: int, tails: bool = True) -> None:
        self.mode, self.dep, self.profile, self.slo_ms = mode, dep, profile, slo_ms
        self.clock = VirtualClock()
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.costs = HostCosts(profile, self.rng, tails)
        self._model, self._tasks, self._max_len, self._tails = model, tasks, max_len, tails
        self.services: dict[str, Any] = {}
        self.cores: dict[str, CoreSet] = {}
        self.router: Any = None
        self.transport: SimulatedTransport | None = None

    async def start(self) -> None:
        from grstack.runtime.serve import CostBackend, DramTier, RankerService, RelayEngine, Router

        dep = self.dep
        dram_bytes = int(dep.dram_mb_per_server * MB) if _uses_dram(self.mode) else 0
        drams = [DramTier(dram_bytes, dep.dram_ttl_s, self.clock) for _ in range(dep.servers)]
        kv_bytes = self.profile.model.get("kv_bytes_per_token")
        for i in range(dep.replicas):
            url = f"sim://{self.mode}/ranker-{i}"
            cfg = ranker_config(self.mode, dep, self._max_len)
            cores = (SharedCores if dep.shared_cores else CoreSet)(dep.cores_per_replica)
            device = CoreSet(1) if dep.accelerator else cores
            engine = RelayEngine(self._model, device="cpu", max_suffix=cfg.max_suffix, chunk=cfg.chunk,
                                 kv_dtype=cfg.kv_dtype)
            backend = CostBackend(engine, self.profile, self.clock.charge, tasks=len(self._tasks),
                                       kv_bytes_per_token=int(kv_bytes) if kv_bytes else None,
                                       rng=np.random.default_rng(int(self.rng.integers(1 << 62))), tails=self._tails)
            # the DRAM copy is the same object: its bytes are what the tiers count, its move what promote charges
            self.services[url] = RankerService(self._model, self._tasks, cfg, clock=self.clock, backend=backend,
                                               cpu=lambda: 0.0, dram=drams[dep.server_of(i)],
                                               runner=VirtualComputeRunner(self.clock, device),
                                               promote=self._promote(backend), to_host=lambda kv: kv)
            self.cores[url] = cores
        self.transport = SimulatedTransport(self.costs, self.cores, self.clock)
        self.transport.services.update(self.services)
        for i, (url, service) in enumerate(self.services.items()):
            await service.start(url)
            if self.profile.startup:  # what a real ranker measured at start-up, not its in-service costs
                service.profile = startup_profile(service.profile, self.profile.startup, self.mode, i)
        self.router = Router(real.router_config(self.mode, list(self.services), self.slo_ms),
                             transport=self.transport, clock=self.clock,
                             rng=random.Random(self.seed))  # not drawn from self.rng: its other draws stay as they were
        await self.router.start()
        # The real benchmark's router runs through the whole sweep, so traffic always meets one that has read its
        # rankers' load: with none read yet its trigger judges risk by the idle time (trigger.py), and a point
        # started on a router just up refused the first seconds' at-risk signals the real one admits. Idle until
        # two load reports are in, as the real one is.
        await asyncio.sleep(ROUTER_SETTLE_POLLS * self.router.config.load_poll_interval_s)

    def _promote(self, backend: Any) -> Any:
        async def promote(kv: Any) -> Any:
            seconds = backend.promotion_s(kv)
            if seconds:
                await asyncio.sleep(seconds)  # the copy engine's: it holds no core
            return kv
        return promote

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for service in self.services.values():
            await service.stop()

    def trigger_counts(self) -> dict[str, float]:
        text = generate_latest(self.router.metrics.registry).decode()
        return {reason: float(v) for reason, v in _TRIGGER_LINE.findall(text)}

    def ranker_state(self) -> list[dict[str, Any]]:
        out = []
        for s in self.services.values():
            stats = s.stats().model_dump()
            out.append({**stats, "joined": stats.get("joined_ranks", 0)})
        return out

    def queued(self) -> int:
        return sum(sum(s.scheduler.depth().values()) for s in self.services.values())


async def _send(dep: SimulatedDeployment, req: Any, scheduled: float, deadline_ms: float | None) -> Any:
    """One request through the router as the HTTP app does it, with the harness's and the router's hops."""
    from grstack.runtime.serve import PrefillRequest, RankRequest, RequestError, Result

    loop = asyncio.get_running_loop()
    hop = dep.costs.hop("harness") + dep.costs.hop("router")
    await asyncio.sleep(hop / 2)
    try:
        if req.path == "/v1/prefill":
            await dep.router.prefill(req.body, dep.transport.parse(req.body, PrefillRequest))
            await asyncio.sleep(hop / 2)
            return Result(req, 200, (loop.time() - scheduled) * 1e3, None)
        late_ms = max(0.0, (loop.time() - scheduled) * 1e3)
        budget = None if deadline_ms is None else max(deadline_ms - late_ms, 0.1)
        resp = await dep.router.rank(req.body, dep.transport.parse(req.body, RankRequest), budget)
        status, headers, body = resp.status, dict(resp.headers), resp.body
    except RequestError as exc:
        status, headers, body = exc.status, {}, b""
    await asyncio.sleep(hop / 2)
    latency = (loop.time() - scheduled) * 1e3
    payload = None
    if status == 200 and body:
        import json

        payload = json.loads(body)
    return Result(req, status, latency, payload, headers=headers)


async def run_open_loop(dep: SimulatedDeployment, requests: list[Any], deadline_ms: float | None,
                        give_up: Any = None) -> list[Any]:
    """:func:`grstack.runtime.serve.loadgen.run_open_loop` on virtual time against ``dep``'s router."""
    loop = asyncio.get_running_loop()
    order = sorted(requests, key=lambda r: r.at)
    t0 = loop.time() + 0.05
    tasks = []
    violations = 0

    def count(task: asyncio.Task[Any]) -> None:
        nonlocal violations
        r = task.result()
        if give_up is not None and r.request.measure and (r.status != 200 or r.latency_ms > give_up.slo_ms):
            violations += 1

    for req in order:
        delay = t0 + req.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if give_up is not None and violations >= give_up.violations:
            break
        budget = deadline_ms if req.path == "/v1/rank" else None
        task = loop.create_task(_send(dep, req, t0 + req.at, budget))
        task.add_done_callback(count)
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


def sim_requests(trace: Trace, tag: str) -> tuple[list[Any], dict[bytes, Any], dict[bytes, tuple[int, int]]]:
    """The trace as :func:`grstack.runtime.bench.serve.encode` sends it — a signal per visit, its rank when it is
    followed, warm-up ranks not measured — with each request built as the model the HTTP app would parse (its
    body a short name for it), and each request's (events, candidates) for its CPU draws."""
    from grstack.runtime.serve import Events, PrefillRequest, RankRequest, Request

    reqs: list[Any] = []
    models: dict[bytes, Any] = {}
    sizes: dict[bytes, tuple[int, int]] = {}
    long_terms: dict[tuple[int, int], Any] = {}
    for k, v in enumerate(trace.visits):
        user = f"{tag}-u{v.user}"
        key = (v.user, len(v.long_items))
        if key not in long_terms:
            # arrays, not lists: every reader of a request's events takes them through numpy
            long_terms[key] = Events.model_construct(items=v.long_items, timestamps=v.long_ts, actions=None)
        lt = long_terms[key]
        pre = f"{user}/{k}/prefill".encode()
        models[pre] = PrefillRequest.model_construct(user_id=user, long_term=lt, user_features=None, wait=False)
        sizes[pre] = (len(v.long_items), 0)
        reqs.append(Request(v.wall_s, "/v1/prefill", pre, user, False))
        if v.ranked:
            body = f"{user}/{k}/rank".encode()
            short = Events.model_construct(items=v.short_items, timestamps=v.short_ts, actions=None)
            models[body] = RankRequest.model_construct(user_id=user, long_term=lt, short_term=short,
                                                       candidates=v.candidates, timestamp=int(v.t),
                                                       user_features=None)
            sizes[body] = (len(v.long_items) + len(v.short_items), len(v.candidates))
            reqs.append(Request(v.rank_s, "/v1/rank", body, user, k >= trace.config.warmup))
    return reqs, models, sizes


async def measure_point(dep: SimulatedDeployment, trace: Trace, tag: str, slo_ms: float,
                        whole: bool = False) -> dict[str, Any]:
    """One run of a point's trace on ``dep`` (started): the real benchmark's point fields, from the same
    summary, plus ``latencies_ms`` (the measured ranks', failures as inf) for the intervals."""
    from grstack.runtime.serve import GiveUp, violations_to_fail

    assert dep.transport is not None
    reqs, dep.transport.requests, dep.transport.sizes = sim_requests(trace, tag)
    planned = sum(r.measure for r in reqs)
    give_up = None if whole else GiveUp(slo_ms, violations_to_fail(planned))
    before, decided = dep.ranker_state(), dep.trigger_counts()
    results = await run_open_loop(dep, reqs, slo_ms, give_up)
    for _ in range(6000):  # drain: prefills signalled near the end still run (bounded: 10 virtual minutes)
        if dep.queued() == 0:
            break
        await asyncio.sleep(0.1)
    after = dep.ranker_state()
    visits = sum(r.request.path == "/v1/rank" for r in results)
    sent = [r.latency_ms if r.status == 200 else math.inf for r in results if r.request.measure]
    out = {"trace_seed": trace.config.seed, **real.summarize(results, slo_ms, planned),
           **real.state_deltas(before, after, visits),
           "trigger_decisions": real.trigger_deltas(decided, dep.trigger_counts()), "trace": trace.shape,
           # the measured ranks' latencies, the unsent ones (the point gave up) as failures: the pessimistic
           # completion, and as 0 ms: the optimistic one (any completion's P99 lies between the two)
           "latencies_ms": sent + [math.inf] * (planned - len(sent)),
           "latencies_ms_optimistic": sent + [0.0] * (planned - len(sent))}
    return out

"""The load the router routes by: its own rank requests in flight per replica, and the rank queues the rankers
report on ``GET /v1/stats`` (polled; other routers' requests are in those). A replica over its load cap gives
its placed users up to the bounded-load ring.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from grstack.runtime.serve.placement import Replica
from grstack.runtime.serve.router_config import RouterConfig
from grstack.runtime.serve.transport import RankerTransport, TransportError


class LoadView:
    """``on_report(replica, stats)``: what else reads each poll's stats (the trigger's per-ranker budgets; None
    stats when the ranker did not answer)."""

    def __init__(self, config: RouterConfig, on_report: Callable[[str, dict[str, Any] | None], None]) -> None:
        self.config = config
        self._on_report = on_report
        self.inflight: dict[str, int] = {}  # rank requests in flight per replica (the routing load)
        self.inflight_other: dict[str, int] = {}  # prefills and other requests in flight per replica
        self.queued: dict[str, int] = {}  # replica -> ranks queued (hits + misses), as its last /v1/stats reported

    def counter(self, path: str) -> dict[str, int]:
        """The in-flight count a request to ``path`` belongs to."""
        return self.inflight if path == "/v1/rank" else self.inflight_other

    async def poll(self, up: list[str], replicas: Mapping[str, Replica], transport: RankerTransport) -> None:
        """Reads every up ranker's ``/v1/stats`` into the queue depths and ``on_report``."""
        await asyncio.gather(*(self._poll_stats(rid, replicas, transport) for rid in up), return_exceptions=True)
        for rid in [r for r in self.queued if r not in replicas]:
            del self.queued[rid]

    async def _poll_stats(self, rid: str, replicas: Mapping[str, Replica], transport: RankerTransport) -> None:
        replica = replicas.get(rid)
        if replica is None:
            return
        stats: Any = None
        with contextlib.suppress(TransportError, TimeoutError, ValueError):
            reply = await transport.get(replica.url, "/v1/stats", 1.0)
            if reply.status == 200:
                stats = reply.json()
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
        self._on_report(rid, stats)

    def view(self, up: list[str]) -> dict[str, int]:
        """Rank requests on each up replica: this router's in flight, or the rank queue the ranker reported if
        longer. Prefills are not counted: one held open while its prefix computes is background work, and
        counting it moved users off the replica holding their prefix to a miss elsewhere (18 of 1,250 ranks,
        each a full inference, at 512 tokens and 40 QPS)."""
        return {r: max(self.inflight.get(r, 0), self.queued.get(r, 0)) for r in up}

    def over_cap(self, rid: str, load: dict[str, int]) -> bool:
        mine = load.get(rid, 0)
        if len(load) < 2 or mine < self.config.overload_min_load:
            return False
        return mine > self.config.load_factor * sum(load.values()) / len(load)

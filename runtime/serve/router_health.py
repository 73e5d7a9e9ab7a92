"""Which replicas the router may send work to: down (unreachable until ``/readyz`` answers) and ejected (outlier
detection: consecutive failures or a median latency far above the others', for a period that grows with
recent ejections). The router's ring is rebuilt through ``on_change`` whenever that set changes.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections import deque
from collections.abc import Callable, Collection, Mapping

from grstack.runtime.serve.clock import Now
from grstack.runtime.serve.placement import Replica
from grstack.runtime.serve.router_config import RouterConfig
from grstack.runtime.serve.transport import RankerTransport, TransportError

log = logging.getLogger("grstack.runtime.serve.router")  # the router's log, whichever part speaks


class ReplicaHealth:
    """``members``: the replicas registered now; ``on_eject(reason)``: counts an ejection (a metric)."""

    def __init__(self, config: RouterConfig, clock: Now, members: Callable[[], Collection[str]],
                 on_change: Callable[[], None], on_eject: Callable[[str], None]) -> None:
        self.config = config
        self.clock = clock
        self._members = members
        self._on_change = on_change
        self._on_eject = on_eject
        self.down: set[str] = set()
        self.ejected: dict[str, float] = {}  # replica -> clock time its ejection ends
        self._ejections: dict[str, int] = {}
        self._returned: dict[str, float] = {}  # replica -> when its last ejection ended
        self._failures: dict[str, int] = {}
        self._latencies: dict[str, deque[float]] = {}

    def usable(self, rid: str) -> bool:
        return rid not in self.down and rid not in self.ejected

    # -- reachability -------------------------------------------------------------------------------
    def mark_down(self, rid: str) -> None:
        if rid not in self.down:
            log.warning("ranker %s is down", rid)
            self.down.add(rid)
            self._on_change()

    async def probe(self, rid: str, replicas: Mapping[str, Replica], transport: RankerTransport) -> None:
        """Reads ``/readyz``: a down replica that answers is up again, an up one that does not is down."""
        replica = replicas.get(rid)
        if replica is None:
            return
        ok = False
        with contextlib.suppress(TransportError, TimeoutError):
            ok = (await transport.get(replica.url, "/readyz", 1.0)).status == 200
        if ok and rid in self.down:
            self.down.discard(rid)
            self._on_change()
        elif not ok and rid not in self.down:
            self.mark_down(rid)

    # -- outlier detection --------------------------------------------------------------------------
    def release_ejections(self) -> None:
        now = self.clock()
        back = [r for r, until in self.ejected.items() if until <= now]
        for rid in back:
            del self.ejected[rid]
            self._returned[rid] = now
            self._failures[rid] = 0
            self._latencies.pop(rid, None)
            log.info("ranker %s returns after its ejection", rid)
        if back:
            self._on_change()

    def eject(self, rid: str, reason: str) -> bool:
        cfg = self.config
        members = self._members()
        if rid in self.ejected or rid not in members:
            return False
        cap = max(1, int(cfg.outlier_max_ejected_fraction * len(members)))
        if len(self.ejected) + 1 > cap:
            return False
        now = self.clock()
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
        self._on_eject(reason)
        log.warning("ranker %s ejected for %.1f s (%s)", rid, period, reason)
        self._on_change()
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
        members = self._members()
        others = [statistics.median(v) for r, v in self._latencies.items()
                  if r != rid and r in members and r not in self.ejected
                  and len(v) >= cfg.outlier_latency_min_samples]
        if len(others) + 1 < cfg.outlier_latency_min_hosts or not others:
            return
        mine, theirs = statistics.median(lat), statistics.median(others)
        if mine * 1e3 > cfg.outlier_latency_floor_ms and mine > cfg.outlier_latency_factor * theirs:
            self.eject(rid, "latency")

"""Forwarding a rank: its replicas tried in order within its deadline, retries capped by a retry budget, and each
attempt's outcome told to outlier detection. Overload answers (503 queue-full / predicted-late) move on to the
next replica without counting as faults; a deadline passed is answered 504 and never retried.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping

from aiohttp import web
from prometheus_client import Counter

from grstack.runtime.serve.clock import Now, SystemClock
from grstack.runtime.serve.http import (
    DEADLINE_HEADER,
    FORWARD_MS_HEADER,
    RANKER_MS_HEADER,
    RequestError,
    error_response,
)
from grstack.runtime.serve.placement import Replica
from grstack.runtime.serve.router_config import RouterConfig
from grstack.runtime.serve.router_health import ReplicaHealth
from grstack.runtime.serve.router_load import LoadView
from grstack.runtime.serve.transport import RankerTransport, Reply, TransportError, Unreachable

log = logging.getLogger("grstack.runtime.serve.router")  # the router's log, whichever part speaks


class RetryBudget:
    """Retries allowed: ``ratio`` x requests + ``minimum`` over a sliding window of ``window_s``."""

    def __init__(self, ratio: float, minimum: int, window_s: float, clock: Now | None = None) -> None:
        self.ratio, self.minimum, self.window_s = ratio, minimum, window_s
        self.clock: Now = clock if clock is not None else SystemClock()
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


class Forwarder:
    """Sends requests to replicas through ``transport``, counting them in flight on ``load``; forwards ranks.
    ``shed``/``retries``/``retries_denied``: the router's counters of those outcomes."""

    def __init__(self, config: RouterConfig, clock: Now, transport: RankerTransport,
                 replicas: Callable[[], Mapping[str, Replica]], health: ReplicaHealth, load: LoadView,
                 shed: Counter, retries: Counter, retries_denied: Counter) -> None:
        self.config = config
        self.clock = clock
        self.transport = transport
        self._replicas = replicas
        self.health = health
        self.load = load
        self.retry_budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min,
                                        config.retry_budget_window_s, clock)
        self._shed, self._retries, self._retries_denied = shed, retries, retries_denied

    async def post(self, rid: str, path: str, body: bytes, timeout_s: float,
                   headers: dict[str, str] | None = None) -> Reply:
        """POSTs to replica ``rid`` (KeyError when it is not registered), counted in flight meanwhile."""
        url = self._replicas()[rid].url
        counter = self.load.counter(path)
        counter[rid] = counter.get(rid, 0) + 1
        try:
            return await self.transport.post(url, path, body, timeout_s, headers)
        finally:
            counter[rid] -= 1

    async def rank(self, body: bytes, order: list[str], kind: str, deadline: float,
                   budget_ms: float) -> web.Response:
        """Tries ``order`` until one answers (``kind``: how the first was chosen, told to the client)."""
        self.retry_budget.request()
        last_error, shed_retry_after, shed_reason = "", None, "queue-full"
        for attempt, rid in enumerate(order):
            if rid not in self._replicas():
                continue
            remaining = deadline - self.clock()
            if remaining <= 0:
                self._shed.labels("deadline").inc()
                return error_response(504, f"deadline exceeded after {attempt} attempt(s) ({last_error})",
                                      headers={"X-Grstack-Shed": "deadline"})
            if attempt:
                if not self.retry_budget.try_retry():
                    self._retries_denied.inc()
                    last_error += "; retry budget exhausted"
                    break
                self._retries.inc()
            t0 = self.clock()
            budget_bound = remaining < self.config.rank_timeout_s  # this try ends at the request's deadline
            try:
                reply = await self.post(rid, "/v1/rank", body, min(self.config.rank_timeout_s, remaining),
                                        {DEADLINE_HEADER: f"{remaining * 1e3:.1f}"})
            except Unreachable as exc:
                last_error = f"{rid}: {exc.kind}"
                self.health.mark_down(rid)  # nothing listens: down until /readyz answers
                continue
            except TimeoutError as exc:
                if budget_bound:
                    # The deadline passed while the ranker worked on it: shed (504), never retried. Under load
                    # every replica is late alike, so this is a latency sample for outlier detection (a hung
                    # replica stands out against the others), not a failure that ejects.
                    self.health.record_slow(rid, self.clock() - t0)
                    self._shed.labels("deadline").inc()
                    return error_response(504, f"deadline exceeded: {rid} did not answer within the "
                                               f"{budget_ms:.0f} ms budget",
                                          headers={"X-Grstack-Shed": "deadline",
                                                   "X-Grstack-Attempts": str(attempt + 1)})
                last_error = f"{rid}: {type(exc).__name__}"
                self.health.record_failure(rid)  # slow is not down: outlier detection decides
                continue
            except TransportError as exc:
                last_error = f"{rid}: {exc.kind}"
                self.health.record_failure(rid)
                continue
            status, payload, headers = reply.status, reply.body, reply.headers
            if status == 504:  # the ranker dropped it at its deadline: nobody waits for a retry
                self._shed.labels("deadline").inc()
                return web.Response(status=status, body=payload, content_type="application/json",
                                    headers={"X-Grstack-Shed": "deadline", "X-Grstack-Attempts": str(attempt + 1)})
            if status == 503 and headers.get("X-Grstack-Shed") in ("queue-full", "predicted-late"):
                shed_reason = headers["X-Grstack-Shed"]
                last_error = f"{rid}: {shed_reason}"
                shed_retry_after = headers.get("Retry-After", "1")
                continue  # overload is not a fault: no outlier count
            if status >= 500:
                last_error = f"{rid}: HTTP {status}"
                self.health.record_failure(rid)
                continue
            if status in (401, 403):  # the router's own token or certificate was refused: not the client's fault
                log.warning("ranker %s refused the router's credentials (HTTP %d): check --ranker-token-file "
                            "and --ranker-cert", rid, status)
                last_error = f"{rid}: refused the router's credentials (HTTP {status})"
                continue
            took = self.clock() - t0
            self.health.record_success(rid, took)
            hops = {FORWARD_MS_HEADER: f"{took * 1e3:.3f}"}
            if RANKER_MS_HEADER in headers:  # what of the round trip the ranker spent: the link is the rest
                hops[RANKER_MS_HEADER] = headers[RANKER_MS_HEADER]
            return web.Response(status=status, body=payload, content_type="application/json",
                                headers={"X-Grstack-Route": kind, "X-Grstack-Attempts": str(attempt + 1), **hops})
        if shed_retry_after is not None:
            self._shed.labels(shed_reason).inc()
            return error_response(503, f"overloaded: every ranker tried refused it ({last_error})",
                                  headers={"Retry-After": shed_retry_after, "X-Grstack-Shed": shed_reason})
        raise RequestError(503, f"every ranker replica failed ({last_error})")

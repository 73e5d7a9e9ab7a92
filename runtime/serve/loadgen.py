"""Open-loop load: requests are sent at pre-drawn (Poisson) times whether or not earlier ones finished.

Latency is measured from each request's scheduled send time, so a server that falls behind is charged for
the queueing it causes (no coordinated omission). A request that fails or times out counts as a latency
of +inf, so it always violates an SLO. ``Result.kind`` sorts answers into ok / shed (503 or 504 carrying
``X-Grstack-Shed``) / other errors, as the overload checks count them.

With ``deadline_ms`` a request of ``deadline_paths`` carries the caller's remaining budget in
``X-Grstack-Deadline-Ms``: ``deadline_ms`` minus how late it is sent after its scheduled time, the way a
cascade stage passes its remaining deadline downstream. The server then measures its budget from the same
instant the latency is measured from, and sheds what cannot be answered in time as the caller sees it.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from grstack.runtime.serve.http import DEADLINE_HEADER


@dataclass
class Request:
    at: float  # seconds after the start of the run
    path: str  # /v1/prefill | /v1/rank
    body: bytes
    user: str
    measure: bool = True  # False: part of the load, but not of the latency statistics


@dataclass
class Result:
    request: Request
    status: int  # 0: no HTTP answer (connection error or timeout)
    latency_ms: float
    payload: dict[str, Any] | None
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``ok`` (200), ``shed_503`` / ``shed_504`` (refused or dropped on purpose, ``X-Grstack-Shed``), or an
        error: ``timeout``, ``connection``, ``http_<status>``."""
        if self.status == 200:
            return "ok"
        if self.status in (503, 504) and "X-Grstack-Shed" in self.headers:
            return f"shed_{self.status}"
        if self.status == 0:
            return "timeout" if "Timeout" in self.error.split(":", 1)[0] else "connection"
        return f"http_{self.status}"


def poisson_times(qps: float, n: int, rng: np.random.Generator) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / qps, n))


async def _send(session: aiohttp.ClientSession, base_url: str, req: Request, scheduled: float,
                timeout_s: float, deadline_ms: float | None = None) -> Result:
    loop = asyncio.get_running_loop()
    headers = {"Content-Type": "application/json"}
    if deadline_ms is not None:
        late_ms = max(0.0, (loop.time() - scheduled) * 1e3)
        headers[DEADLINE_HEADER] = f"{max(deadline_ms - late_ms, 0.1):.1f}"  # spent: the server sheds it at once
    try:
        async with session.post(base_url + req.path, data=req.body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            raw = await resp.read()
            latency = (loop.time() - scheduled) * 1e3
            payload = json.loads(raw) if raw else None
            return Result(req, resp.status, latency, payload, headers=dict(resp.headers))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Result(req, 0, math.inf, None, f"{type(exc).__name__}: {exc}")


def violations_to_fail(n: int, q: float = 99.0) -> int:
    """How many of ``n`` latencies above an SLO make their ``q``-th percentile (numpy's ``higher`` method, as
    :func:`latency_summary` takes it) exceed that SLO: the percentile is the value of sorted index
    ceil(q/100·(n−1)), so the point fails once the values from that index to the end can all be violations."""
    return n - math.ceil(q / 100.0 * (n - 1) - 1e-9)


@dataclass(frozen=True)
class GiveUp:
    """Stop sending once ``violations`` measured requests have answered later than ``slo_ms`` or not at all:
    the run's percentile is then above the SLO whatever the rest would do (:func:`violations_to_fail`)."""

    slo_ms: float
    violations: int


async def run_open_loop(base_url: str, requests: list[Request], timeout_s: float = 5.0,
                        session: aiohttp.ClientSession | None = None, deadline_ms: float | None = None,
                        deadline_paths: tuple[str, ...] = ("/v1/rank",),
                        give_up: GiveUp | None = None) -> list[Result]:
    """Sends every request at its time; returns results in the order of ``requests``' send times. With
    ``deadline_ms``, requests to ``deadline_paths`` carry the remaining budget (module doc). With ``give_up``
    the requests not yet sent when it is reached are never sent, and have no result; the ones in flight are
    waited for."""
    own = session is None
    session = session or aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
    loop = asyncio.get_running_loop()
    order = sorted(requests, key=lambda r: r.at)
    t0 = loop.time() + 0.05
    tasks = []
    violations = 0

    def count(task: asyncio.Task[Result]) -> None:
        nonlocal violations
        r = task.result()
        if give_up is not None and r.request.measure and (r.status != 200 or r.latency_ms > give_up.slo_ms):
            violations += 1

    try:
        for req in order:
            delay = t0 + req.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if give_up is not None and violations >= give_up.violations:
                break
            budget = deadline_ms if req.path in deadline_paths else None
            task = loop.create_task(_send(session, base_url, req, t0 + req.at, timeout_s, budget))
            task.add_done_callback(count)
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    finally:
        if own:
            await session.close()


def latency_summary(results: list[Result]) -> dict[str, float]:
    lat = np.array([r.latency_ms if r.status == 200 else math.inf for r in results if r.request.measure])
    if lat.size == 0:
        return {"n": 0, "p50_ms": math.nan, "p99_ms": math.nan, "errors": 0}
    return {"n": int(lat.size), "p50_ms": float(np.percentile(lat, 50, method="higher")),
            "p99_ms": float(np.percentile(lat, 99, method="higher")),
            "errors": int(np.sum(~np.isfinite(lat)))}

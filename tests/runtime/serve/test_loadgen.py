"""The open-loop load generator: the caller's remaining deadline travels with each rank request; a run gives up
once its percentile is certain to miss the SLO."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from grstack.runtime.serve.http import DEADLINE_HEADER, start_site
from grstack.runtime.serve.loadgen import GiveUp, Request, run_open_loop, violations_to_fail

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


async def test_a_late_send_carries_the_budget_left_and_other_paths_none() -> None:
    seen: list[tuple[str, str | None]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get(DEADLINE_HEADER)))
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/rank", record)
    app.router.add_post("/v1/prefill", record)
    runner, url = await start_site(app, "127.0.0.1", 0)
    try:
        reqs = [Request(0.0, "/v1/prefill", b"{}", "u"), Request(0.0, "/v1/rank", b"{}", "u"),
                Request(0.5, "/v1/rank", b"{}", "v")]
        loop = asyncio.get_running_loop()
        # the generator is blocked from just before the first send until 0.3 s after it: those sends are late
        loop.call_later(0.04, time.sleep, 0.35)
        async with aiohttp.ClientSession() as session:
            results = await run_open_loop(url, reqs, session=session, deadline_ms=250.0)
            assert all(r.status == 200 for r in results)
            late = dict(seen)
            assert late["/v1/prefill"] is None
            ranks = [float(v) for p, v in seen if p == "/v1/rank"]
            assert ranks[0] == pytest.approx(0.1)  # 300+ ms late against 250 ms: spent, shed at once downstream
            assert 150.0 < ranks[1] <= 250.0  # on time: (nearly) the whole budget
            seen.clear()
            await run_open_loop(url, reqs[1:2], session=session)
            assert seen == [("/v1/rank", None)]  # no deadline_ms: no header
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("n", [*range(1, 60), 99, 100, 101, 999, 1000, 1001, 1250, 3000])
def test_violations_to_fail_is_where_the_p99_crosses_the_slo(n: int) -> None:
    k = violations_to_fail(n)
    slo = 100.0
    for bad, crosses in ((k - 1, False), (k, True)):
        lat = np.full(n, 10.0)
        lat[:bad] = np.inf
        assert (np.percentile(lat, 99, method="higher") > slo) == crosses, (n, bad)


async def test_giving_up_stops_sending_and_keeps_what_was_sent() -> None:
    arrivals = 0

    async def slow_then_fast(request: web.Request) -> web.Response:
        nonlocal arrivals
        arrivals += 1
        if arrivals <= 3:
            await asyncio.sleep(0.15)  # later than the 100 ms SLO
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/rank", slow_then_fast)
    runner, url = await start_site(app, "127.0.0.1", 0)
    try:
        # the first request is slow but not measured: it does not count towards giving up
        reqs = [Request(0.02 * i, "/v1/rank", b"{}", f"u{i}", measure=i > 0) for i in range(40)]
        async with aiohttp.ClientSession() as session:
            results = await run_open_loop(url, reqs, session=session, give_up=GiveUp(slo_ms=100.0, violations=2))
            assert 3 <= len(results) < 40
            assert [r.request.user for r in results] == [f"u{i}" for i in range(len(results))]
            assert sum(r.latency_ms > 100.0 for r in results if r.request.measure) >= 2
            assert arrivals == len(results)  # nothing was sent that has no result
            arrivals = 3  # every answer fast now: well inside a 1 s SLO, so all 40 are sent
            assert len(await run_open_loop(url, reqs, session=session, give_up=GiveUp(1000.0, 2))) == 40
    finally:
        await runner.cleanup()

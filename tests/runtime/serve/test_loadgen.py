"""The open-loop load generator: the caller's remaining deadline travels with each rank request."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from grstack.runtime.serve.http import DEADLINE_HEADER, start_site
from grstack.runtime.serve.loadgen import Request, run_open_loop

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

"""What service cost, as the ranker reports it: ``GET /v1/steps`` (the compute steps and each answered request's
CPU outside them, read incrementally) and the headers that split a rank's time into the ranker's and the hops."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest

from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker
from grstack.runtime.serve.router import Router, RouterConfig
from grstack.runtime.serve.schemas import RankRequest, StepsResponse
from grstack.runtime.serve.transport_local import InProcessTransport
from grstack.runtime.serve.trigger import TriggerConfig

pytestmark = pytest.mark.integration


def rank_body(user: str, seed: int, n_long: int, n_short: int = 3, cands: int = 5) -> dict:
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 301, n_long + n_short).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n_long + n_short))).tolist()
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]},
            "candidates": list(range(1, cands + 1)), "timestamp": ts[-1] + 10}


@pytest.fixture
async def ranker(kit: SimpleNamespace):
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8, step_log=64))
    runner, url = await start_ranker(service)
    async with aiohttp.ClientSession() as session:
        yield SimpleNamespace(service=service, url=url, http=session)
    await runner.cleanup()


async def test_steps_endpoint_returns_the_steps_and_request_cpu_of_service(ranker: SimpleNamespace) -> None:
    async def steps(**query: int) -> StepsResponse:
        async with ranker.http.get(ranker.url + "/v1/steps", params={k: str(v) for k, v in query.items()}) as resp:
            assert resp.status == 200
            return StepsResponse.model_validate(await resp.json())

    start = await steps()
    assert start.steps == [] and start.requests == []  # the start-up profile is not service
    assert start.capacity == 64
    hit = rank_body("u1", 1, 20)
    async with ranker.http.post(ranker.url + "/v1/prefill",
                                data=json.dumps({"user_id": "u1", "long_term": hit["long_term"]})) as resp:
        assert resp.status == 200 and float(resp.headers["X-Grstack-Ranker-Ms"]) > 0
    for body in (hit, rank_body("u2", 2, 5, cands=7)):  # a cached rank, then a short miss (full inference)
        async with ranker.http.post(ranker.url + "/v1/rank", data=json.dumps(body)) as resp:
            assert resp.status == 200 and float(resp.headers["X-Grstack-Ranker-Ms"]) > 0
    got = await steps()
    kinds = [s.kind for s in got.steps]
    assert kinds == ["extend_many", "rank_cached", "rank_full"]  # the prefill in one step, then the two ranks
    assert (got.steps[0].batch, got.steps[0].tokens, got.steps[0].context) == (1, 20, 0)
    assert got.steps[0].pairs == 20 * 21 // 2
    assert (got.steps[1].batch, got.steps[1].tokens, got.steps[1].context) == (1, 3 + 5, 20)
    assert (got.steps[2].tokens, got.steps[2].context) == (5 + 3 + 7, 0)
    assert all(s.seconds > 0 for s in got.steps)
    assert [(r.endpoint, r.events, r.candidates) for r in got.requests] == [("prefill", 20, 0), ("rank", 23, 5),
                                                                            ("rank", 8, 7)]
    assert all(r.parse_s > 0 and r.encode_s > 0 and r.reply_s > 0 for r in got.requests)
    again = await steps(since=got.next_since, requests_since=got.next_requests_since)
    assert again.steps == [] and again.requests == [] and again.next_since == got.next_since
    tail = await steps(since=1)
    assert [s.seq for s in tail.steps] == [2, 3] and tail.steps_dropped == 0
    async with ranker.http.get(ranker.url + "/v1/steps", params={"since": "x"}) as resp:
        assert resp.status == 422
    async with ranker.http.get(ranker.url + "/openapi.json") as resp:
        assert "/v1/steps" in (await resp.json())["paths"]


async def test_a_small_ring_counts_the_steps_a_reader_missed(kit: SimpleNamespace) -> None:
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8, step_log=2))
    await service.start("mem://r")
    try:
        for i in range(3):
            await service.rank(RankRequest.model_validate(rank_body(f"u{i}", i, 4)))
        got = service.steps_since(0)
        assert [s.seq for s in got.steps] == [2, 3] and got.steps_dropped == 1
        assert len(got.requests) == 0  # a direct call is not an answered HTTP request
    finally:
        await service.stop()


async def test_the_router_passes_on_where_a_ranks_time_went(kit: SimpleNamespace) -> None:
    services = {"mem://r0": RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))}
    await services["mem://r0"].start("mem://r0")
    transport = InProcessTransport(services)
    router = Router(RouterConfig(rankers=tuple(services), load_poll_interval_s=0, startup_timeout_s=10.0,
                                 trigger=TriggerConfig(length_threshold=1)), transport=transport)
    await router.start()
    try:
        b = rank_body("u1", 1, 12)
        resp = await router.rank(json.dumps(b).encode(), RankRequest.model_validate(b))
        assert resp.status == 200
        forward, ranker = float(resp.headers["X-Grstack-Forward-Ms"]), float(resp.headers["X-Grstack-Ranker-Ms"])
        assert forward >= ranker > 0  # the link is the difference
        reply = await transport.get("mem://r0", "/v1/steps?since=0&requests_since=0", 1.0)
        got = StepsResponse.model_validate_json(reply.body)
        assert [r.endpoint for r in got.requests] == ["rank"] and got.steps
        assert (await transport.get("mem://r0", "/v1/steps?since=x", 1.0)).status == 422
    finally:
        await router.stop()
        await services["mem://r0"].stop()


async def test_stats_report_what_steps_cost_in_service_against_the_profile(kit: SimpleNamespace) -> None:
    """No factor before enough single-user steps; after them, the ratio the trigger scales its profile by: a
    real positive number (the same math as the profile, so within its clip; its value is the host's)."""
    from grstack.runtime.serve.service_cost import SERVICE_COST_BOUNDS, SERVICE_COST_MIN_STEPS

    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
    await service.start("mem://r")
    try:
        assert service.stats().service_cost_factor is None
        for i in range(SERVICE_COST_MIN_STEPS):  # misses: one single-user full ranking each
            await service.rank(RankRequest.model_validate(rank_body(f"u{i}", i, 20 + i)))
        factor = service.stats().service_cost_factor
        assert factor is not None and SERVICE_COST_BOUNDS[0] <= factor <= SERVICE_COST_BOUNDS[1]
    finally:
        await service.stop()

"""The real router over real rankers with no sockets: the in-process transport calls each RankerService directly,
and routing, placement, caching, retries and the answers are those of the HTTP deployment."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest

from grstack.runtime.serve.clock import ManualClock
from grstack.runtime.serve.ranker import RankerConfig, RankerService
from grstack.runtime.serve.router import Router, RouterConfig
from grstack.runtime.serve.schemas import PrefillRequest, RankRequest, RankResponse
from grstack.runtime.serve.transport import Reply
from grstack.runtime.serve.transport_local import InProcessTransport
from grstack.runtime.serve.trigger import TriggerConfig

pytestmark = pytest.mark.integration

TOL = 1e-5


def rank_body(user: str, seed: int, n_long: int = 30, n_short: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 301, n_long + n_short).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n_long + n_short))).tolist()
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]},
            "candidates": [3, 1, 4, 1, 5], "timestamp": ts[-1] + 10}


async def settle(done: Callable[[], bool], turns: int = 500) -> None:
    """Lets the event loop run (no virtual time passes) until ``done`` holds."""
    for _ in range(turns):
        if done():
            return
        await asyncio.sleep(0)
    assert done(), "the loop did not get there without time passing"


def oracle(service: RankerService, b: dict) -> np.ndarray:
    eng = service.engine
    item = eng.canonical(b["long_term"]["items"], b["long_term"]["timestamps"], b["short_term"]["items"],
                         b["short_term"]["timestamps"], b["candidates"], b["timestamp"])
    return eng.rank_encode([item])[0].numpy()


async def test_router_places_prefills_ranks_hits_and_retries_over_in_process_rankers(kit: SimpleNamespace) -> None:
    cfg = RankerConfig(max_suffix=8, chunk=8)
    services = {f"mem://r{i}": RankerService(kit.make_model(), ["next", "click"], cfg) for i in range(2)}
    for url, service in services.items():
        await service.start(url)
    transport = InProcessTransport(services)
    router = Router(RouterConfig(rankers=tuple(services), load_poll_interval_s=0, startup_timeout_s=10.0,
                                 trigger=TriggerConfig(length_threshold=1)), transport=transport)
    await router.start()
    try:
        assert router.profile is not None and router.up_replicas() == sorted(services)
        b = rank_body("u1", 1)
        signal = {"user_id": "u1", "long_term": b["long_term"], "wait": True}
        pre = await router.prefill(json.dumps(signal).encode(), PrefillRequest.model_validate(signal))
        assert pre.admitted and pre.ranker is not None and pre.ranker.status == "computed"
        home = pre.replica
        assert home in services and router.placements["u1"].replica == home

        body = json.dumps(b).encode()
        resp = await router.rank(body, RankRequest.model_validate(b))
        assert resp.status == 200 and resp.headers["X-Grstack-Route"] == "affinity"
        assert resp.body is not None
        hit = RankResponse.model_validate_json(resp.body)
        assert hit.cache == "device" and hit.replica == home
        np.testing.assert_allclose(np.asarray(hit.scores), oracle(services[home], b), atol=TOL, rtol=0)

        del transport.services[home]  # the user's replica is gone: nothing answers there
        resp = await router.rank(body, RankRequest.model_validate(b))
        assert resp.status == 200 and resp.headers["X-Grstack-Attempts"] == "2" and home in router.down
        assert resp.body is not None
        miss = RankResponse.model_validate_json(resp.body)
        assert miss.cache == "miss" and miss.replica != home
        np.testing.assert_allclose(np.asarray(miss.scores), oracle(services[miss.replica], b), atol=TOL, rtol=0)
    finally:
        await router.stop()
        for service in services.values():
            await service.stop()


async def test_in_process_answers_are_the_ranker_apps_for_bad_and_overloaded_requests(kit: SimpleNamespace) -> None:
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8, max_queue=0))
    transport = InProcessTransport({"mem://r": service})
    starting: Reply = await transport.post("mem://r", "/v1/rank", b"{}", 1.0)
    assert starting.status == 503 and "starting" in starting.json()["error"]
    await service.start("mem://r")
    try:
        bad = await transport.post("mem://r", "/v1/rank", b'{"user_id": "u"}', 1.0)
        assert bad.status == 422
        full = await transport.post("mem://r", "/v1/rank", json.dumps(rank_body("u", 2)).encode(), 1.0)
        assert full.status == 503 and full.headers["X-Grstack-Shed"] == "queue-full"
        assert full.headers["Retry-After"] == "1"
        assert (await transport.get("mem://r", "/readyz", 1.0)).status == 200
        assert (await transport.get("mem://r", "/v1/stats", 1.0)).json()["queued"] == 0
    finally:
        await service.stop()


async def test_the_routers_loops_run_on_its_virtual_clock(kit: SimpleNamespace) -> None:
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
    await service.start("mem://r")
    clock = ManualClock()
    router = Router(RouterConfig(rankers=("mem://r",), load_poll_interval_s=1.0, health_interval_s=1.0),
                    transport=InProcessTransport({"mem://r": service}), clock=clock)
    await router.start()
    try:
        assert router.profile is not None and clock() == 0.0  # started without any virtual time passing
        await settle(lambda: router.queued == {"mem://r": 0})  # the first load poll ran at once
        service.ready = False
        for _ in range(20):
            await asyncio.sleep(0)
        assert router.up_replicas() == ["mem://r"]  # the next probe waits for the health interval
        clock.advance(1.0)
        await settle(lambda: router.down == {"mem://r"})
        for _ in range(20):  # the loops go back to sleep, due one interval after now
            await asyncio.sleep(0)
        service.ready = True
        clock.advance(1.0)
        await settle(lambda: router.up_replicas() == ["mem://r"])
    finally:
        await router.stop()
        await service.stop()

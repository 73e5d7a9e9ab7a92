"""The router: trigger, affinity (in memory and in a real etcd, across a router restart), a killed ranker,
etcd lost mid-run, bad requests."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest

from grstack.runtime.serve.etcd_store import EtcdPlacementStore
from grstack.runtime.serve.placement import Replica
from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker
from grstack.runtime.serve.ring import HashRing
from grstack.runtime.serve.router import Router, RouterConfig, start_router
from grstack.runtime.serve.trigger import TriggerConfig

# Bounded: a hang (a store client that never answers) fails fast instead of stalling the suite.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = "/grstack/ranking/test"


def rank_body(user: str, seed: int, n_long: int = 30, n_short: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    n = n_long + n_short
    items = rng.integers(1, 301, n).tolist()
    ts = (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]}, "candidates": [5, 7, 11, 13],
            "timestamp": ts[-1] + 5}


def prefill_body(rank: dict, wait: bool = True) -> dict:
    return {"user_id": rank["user_id"], "long_term": rank["long_term"], "wait": wait}


async def post(http: aiohttp.ClientSession, url: str, body: dict | bytes) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, timeout=aiohttp.ClientTimeout(total=30)) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def eventually(pred, timeout_s: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.05)


def router_config(**kw) -> RouterConfig:
    return RouterConfig(trigger=TriggerConfig(length_threshold=16), health_interval_s=0.3, startup_timeout_s=30,
                        **kw)


async def start_rankers(kit: SimpleNamespace, n: int, etcd_url: str | None = None) -> list:
    out = []
    for _ in range(n):
        store = EtcdPlacementStore(etcd_url, ROOT) if etcd_url else None
        service = RankerService(kit.make_model(), ["next", "click"],
                                RankerConfig(max_suffix=8, chunk=8, lease_ttl_s=2), store=store)
        runner, url = await start_ranker(service)
        out.append(SimpleNamespace(service=service, runner=runner, url=url))
    return out


async def test_affinity_trigger_and_bad_requests_in_memory(kit: SimpleNamespace) -> None:
    rankers = await start_rankers(kit, 2)
    router = Router(router_config(rankers=tuple(r.url for r in rankers)))
    runner, url = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            placed = {}
            # ring positions depend on the replicas' random ports: 16 users make "all on one replica"
            # a 2**-15 event instead of a few-percent flake
            for i in range(16):
                body = rank_body(f"user-{i}", i)
                status, pre, _ = await post(http, url + "/v1/prefill", prefill_body(body))
                assert status == 200 and pre["admitted"] and pre["ranker"]["status"] == "computed"
                placed[body["user_id"]] = pre["replica"]
                status, out, headers = await post(http, url + "/v1/rank", body)
                assert status == 200 and out["cache"] == "device" and out["replica"] == pre["replica"]
                assert headers["X-Grstack-Route"] == "affinity"
            assert set(placed.values()) == {r.url for r in rankers}  # both replicas hold prefixes
            short = rank_body("short-user", 9, n_long=10)
            status, pre, _ = await post(http, url + "/v1/prefill", prefill_body(short))
            assert status == 200 and not pre["admitted"] and pre["reason"] == "not-at-risk"
            status, out, _ = await post(http, url + "/v1/rank", short)
            assert status == 200 and out["cache"] == "miss"
            for bad, code in ((b"{", 400), ({"user_id": "x", "candidates": [1]}, 422),
                              ({**short, "candidates": [1] * 1_000_000}, 422), (b"[" * (5 << 20), 413)):
                status, err, _ = await post(http, url + "/v1/rank", bad)
                assert status == code and err["error"]
            assert (await post(http, url + "/v1/rank", short))[0] == 200
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'grstack_router_trigger_total{reason="admitted"} 16.0' in text
            assert 'grstack_router_routes_total{kind="affinity"} 16.0' in text
            async with http.get(url + "/openapi.json") as resp:
                assert "/v1/rank" in (await resp.json())["paths"]
    finally:
        await runner.cleanup()
        for r in rankers:
            await r.runner.cleanup()


async def test_no_replica_is_a_503_with_a_message() -> None:
    router = Router(RouterConfig(startup_timeout_s=0.1))
    runner, url = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            status, err, _ = await post(http, url + "/v1/rank", rank_body("u", 1))
            assert status == 503 and "no ranker replica" in err["error"]
            async with http.get(url + "/readyz") as resp:
                assert resp.status == 503
    finally:
        await runner.cleanup()


async def test_a_killed_ranker_causes_no_failed_rank_request(tiny_checkpoint) -> None:
    from grstack.runtime.serve.artifact import load_ranking_model
    from grstack.runtime.serve.engine import RelayEngine
    from grstack.runtime.serve.local import spawn_ranker

    procs = await asyncio.gather(*(spawn_ranker(tiny_checkpoint, ["--device", "cpu", "--max-suffix", "8"])
                                   for _ in range(2)))
    router = Router(router_config(rankers=tuple(p.url for p in procs), rank_timeout_s=10))
    runner, url = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            users: dict[str, dict] = {}
            placed: dict[str, str] = {}
            for i in range(40):
                body = rank_body(f"k-{i}", 100 + i)
                _, pre, _ = await post(http, url + "/v1/prefill", prefill_body(body))
                users[body["user_id"]], placed[body["user_id"]] = body, pre["replica"]
                if min(list(placed.values()).count(p.url) for p in procs) >= 3:
                    break
            victim = procs[0]
            on_victim = [u for u, r in placed.items() if r == victim.url]
            assert len(on_victim) >= 3
            load = [(0.03 * j, users[u]) for j, u in enumerate(list(users) * 3)]
            t0 = asyncio.get_running_loop().time()

            async def send(at: float, body: dict) -> tuple[int, dict, dict]:
                await asyncio.sleep(max(0.0, t0 + at - asyncio.get_running_loop().time()))
                return await post(http, url + "/v1/rank", body)

            tasks = [asyncio.create_task(send(at, b)) for at, b in load]
            await asyncio.sleep(0.03 * len(load) / 3)
            victim.kill()
            results = await asyncio.gather(*tasks)
    finally:
        await runner.cleanup()
        for p in procs:
            await p.stop()
    assert [s for s, _, _ in results] == [200] * len(load)
    late = [out for (at, b), (_, out, _) in zip(load, results, strict=True)
            if b["user_id"] in on_victim and at > 0.03 * len(load) * 2 / 3]
    assert late and all(out["replica"] == procs[1].url and out["cache"] == "miss" for out in late)
    model, _ = load_ranking_model(tiny_checkpoint)
    eng = RelayEngine(model, max_suffix=8)
    for (_, b), (_, out, _) in zip(load, results, strict=True):
        item = eng.canonical(b["long_term"]["items"], b["long_term"]["timestamps"], b["short_term"]["items"],
                             b["short_term"]["timestamps"], b["candidates"], b["timestamp"])
        assert np.abs(eng.rank_encode([item])[0].numpy() - np.array(out["scores"])).max() <= 1e-5


async def test_prefill_and_rank_meet_on_one_replica_across_a_router_restart(kit: SimpleNamespace, etcd) -> None:
    (a,) = await start_rankers(kit, 1, etcd.url)
    (b,) = await start_rankers(kit, 1)  # registered in etcd only after the first router placed the user
    user = next(f"user-{i}" for i in range(1000) if HashRing([a.url, b.url]).order(f"user-{i}")[0] == b.url)
    body = rank_body(user, 1)
    registrar = EtcdPlacementStore(etcd.url, ROOT)
    try:
        async with aiohttp.ClientSession() as http:
            first = Router(router_config(), EtcdPlacementStore(etcd.url, ROOT))
            runner, url = await start_router(first)
            await eventually(lambda: first.up_replicas() == [a.url], what="router sees the first replica")
            status, pre, _ = await post(http, url + "/v1/prefill", prefill_body(body))
            assert status == 200 and pre["replica"] == a.url and pre["ranker"]["status"] == "computed"
            await registrar.register(Replica(b.url, b.url), ttl_s=2)
            await eventually(lambda: b.url in first.up_replicas(), what="router sees the second replica")
            await runner.cleanup()  # the router goes away; placements stay in etcd

            second = Router(router_config(), EtcdPlacementStore(etcd.url, ROOT))
            runner, url = await start_router(second)
            await eventually(lambda: set(second.up_replicas()) == {a.url, b.url}, what="both replicas up")
            assert second.ring.choose(user) == b.url  # the hash ring alone would pick the other replica
            status, out, headers = await post(http, url + "/v1/rank", body)
            assert status == 200 and out["replica"] == a.url and out["cache"] == "device"
            assert headers["X-Grstack-Route"] == "affinity"
            await runner.cleanup()
    finally:
        await registrar.close()
        for r in (a, b):
            await r.runner.cleanup()


async def test_routing_continues_on_the_hash_ring_while_etcd_is_down(kit: SimpleNamespace, etcd) -> None:
    rankers = await start_rankers(kit, 2, etcd.url)
    router = Router(router_config(), EtcdPlacementStore(etcd.url, ROOT, timeout_s=0.5))
    runner, url = await start_router(router)
    try:
        async with aiohttp.ClientSession() as http:
            await eventually(lambda: len(router.up_replicas()) == 2, what="both replicas registered")
            bodies = [rank_body(f"e-{i}", 200 + i) for i in range(4)]
            placed = {}
            for body in bodies:
                _, pre, _ = await post(http, url + "/v1/prefill", prefill_body(body))
                placed[body["user_id"]] = pre["replica"]
            await eventually(lambda: len(router.placements) == 4 and all(
                p.revision >= 0 for p in router.placements.values()), what="placements settled (stored or at home)")

            etcd.kill()
            await eventually(lambda: not router.store_up, what="router notices etcd is gone")
            for body in bodies:  # affinity from the router's local view
                status, out, _ = await post(http, url + "/v1/rank", body)
                assert status == 200 and out["cache"] == "device" and out["replica"] == placed[body["user_id"]]
            fresh = rank_body("e-new", 300)
            status, pre, _ = await post(http, url + "/v1/prefill", prefill_body(fresh))
            assert status == 200 and pre["admitted"] and pre["ranker"]["status"] == "computed"
            assert pre["replica"] == router.ring.choose("e-new")
            status, out, _ = await post(http, url + "/v1/rank", fresh)
            assert status == 200 and out["replica"] == pre["replica"] and out["cache"] == "device"
            for i in range(6):  # users never seen before: plain ring routing, full inference
                status, out, headers = await post(http, url + "/v1/rank", rank_body(f"ring-{i}", 400 + i))
                assert status == 200 and headers["X-Grstack-Route"] == "ring"

            etcd.start()
            await eventually(lambda: router.store_up, what="router reconnects to etcd")
            status, out, _ = await post(http, url + "/v1/rank", bodies[0])
            assert status == 200 and out["replica"] == placed[bodies[0]["user_id"]]
    finally:
        await runner.cleanup()
        for r in rankers:
            await r.runner.cleanup()



async def test_rankers_found_through_dns(kit: SimpleNamespace) -> None:
    """``--rankers-dns``: the router takes the addresses a name resolves to (a headless Service in a cluster;
    localhost here) as its rankers and ranks through them, with no ranker list in its arguments."""
    (ranker,) = await start_rankers(kit, 1)
    port = ranker.url.rsplit(":", 1)[1]
    router = Router(router_config(rankers_dns=f"localhost:{port}", dns_interval_s=0.2))
    runner, url = await start_router(router)
    try:
        await eventually(lambda: f"http://127.0.0.1:{port}" in router.up_replicas(), what="ranker discovered")
        async with aiohttp.ClientSession() as http:
            status, out, _ = await post(http, url + "/v1/rank", rank_body("dns-user", 3))
        assert status == 200 and out["replica"] == f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await ranker.runner.cleanup()

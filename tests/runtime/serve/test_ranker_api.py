"""The ranker's HTTP API: relay hits equal full inference, tiers, single-flight, bad requests, docs, metrics."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest

from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker

pytestmark = pytest.mark.integration


def history(seed: int, n: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 301, n).tolist(), (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()


def rank_body(user: str, seed: int, n_long: int = 30, n_short: int = 5, cands: list[int] | None = None) -> dict:
    items, ts = history(seed, n_long + n_short)
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:], "timestamps": ts[n_long:]},
            "candidates": cands or [3, 1, 4, 1, 5, 9, 2, 6], "timestamp": ts[-1] + 10}


def prefill_body(rank: dict) -> dict:
    return {"user_id": rank["user_id"], "long_term": rank["long_term"]}


@pytest.fixture
async def ranker(kit: SimpleNamespace):
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
    runner, url = await start_ranker(service)
    async with aiohttp.ClientSession() as session:
        yield SimpleNamespace(service=service, url=url, http=session)
    await runner.cleanup()


async def post(r: SimpleNamespace, path: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with r.http.post(r.url + path, data=data) as resp:
        return resp.status, await resp.json()


async def test_prefill_then_rank_hits_and_equals_full_inference(ranker: SimpleNamespace) -> None:
    body = rank_body("alice", 1)
    status, miss = await post(ranker, "/v1/rank", {**body, "user_id": "bob"})  # same sequence, nothing cached
    assert status == 200 and miss["cache"] == "miss"
    status, pre = await post(ranker, "/v1/prefill", prefill_body(body))
    assert status == 200 and pre["status"] == "computed" and pre["prefix_len"] == 30
    status, hit = await post(ranker, "/v1/rank", body)
    assert status == 200 and hit["cache"] == "device" and hit["prefix_hash"] == pre["prefix_hash"]
    assert hit["tasks"] == ["next", "click"] and len(hit["scores"]) == 8 and len(hit["scores"][0]) == 2
    assert np.abs(np.array(hit["scores"]) - np.array(miss["scores"])).max() <= 1e-5
    eng: RelayEngine = ranker.service.engine
    item = eng.canonical(body["long_term"]["items"], body["long_term"]["timestamps"], body["short_term"]["items"],
                         body["short_term"]["timestamps"], body["candidates"], body["timestamp"])
    oracle = eng.rank_encode([item])[0].numpy()
    assert np.abs(np.array(hit["scores"]) - oracle).max() <= 1e-5
    status, again = await post(ranker, "/v1/prefill", prefill_body(body))
    assert again["status"] == "cached"
    changed = {**body, "long_term": {"items": body["long_term"]["items"][:-1],
                                     "timestamps": body["long_term"]["timestamps"][:-1]}}
    assert (await post(ranker, "/v1/rank", changed))[1]["cache"] == "miss"  # another prefix version


async def test_truncation_is_reported_and_still_exact(ranker: SimpleNamespace, kit: SimpleNamespace) -> None:
    body = rank_body("carol", 2, n_long=70, n_short=12)  # max_len 48: prefix keeps 40, suffix keeps 8
    _, pre = await post(ranker, "/v1/prefill", prefill_body(body))
    assert pre["prefix_len"] == kit.MAX_LEN - 8
    _, hit = await post(ranker, "/v1/rank", body)
    _, miss = await post(ranker, "/v1/rank", {**body, "user_id": "dave"})
    assert hit["cache"] == "device" and hit["truncated"] == 30 + 4 and hit["short_len"] == 8
    assert np.abs(np.array(hit["scores"]) - np.array(miss["scores"])).max() <= 1e-5


async def test_concurrent_prefills_compute_once_and_a_rank_waits_for_its_prefill(ranker: SimpleNamespace) -> None:
    body = rank_body("erin", 3, n_long=45)
    results = await asyncio.gather(post(ranker, "/v1/prefill", prefill_body(body)),
                                   post(ranker, "/v1/prefill", prefill_body(body)),
                                   post(ranker, "/v1/rank", body))
    statuses = sorted(r[1]["status"] for r in results[:2])
    assert statuses == ["computed", "joined"]
    assert results[2][1]["cache"] == "device"  # waited for the in-flight prefill instead of recomputing
    assert ranker.service.stats().prefills_computed == 1


async def test_dram_tier_takes_evictions_and_promotes(kit: SimpleNamespace) -> None:
    one = RelayEngine(kit.make_model(), max_suffix=8).kv_bytes_per_token * 30
    service = RankerService(kit.make_model(), ["next", "click"],
                            RankerConfig(max_suffix=8, device_cache_bytes=int(1.5 * one), dram_cache_bytes=10 * one))
    runner, url = await start_ranker(service)
    try:
        async with aiohttp.ClientSession() as http:
            r = SimpleNamespace(url=url, http=http)
            a, b = rank_body("a", 4), rank_body("b", 5)
            await post(r, "/v1/prefill", prefill_body(a))
            await post(r, "/v1/prefill", prefill_body(b))  # a moves to DRAM
            stats = service.stats()
            assert stats.device_entries == 1 and stats.dram_entries == 1
            _, hit = await post(r, "/v1/rank", a)
            assert hit["cache"] == "dram"
            _, hit = await post(r, "/v1/rank", a)
            assert hit["cache"] == "device"
            assert service.stats().promotions == 1
    finally:
        await runner.cleanup()


BAD_REQUESTS = [
    ("malformed JSON", b'{"user_id": "x", ', 400, "malformed JSON"),
    ("empty body", b"", 400, "empty request body"),
    ("no history", {"user_id": "x", "candidates": [1]}, 422, "no history"),
    ("no candidates", {**rank_body("x", 6), "candidates": []}, 422, "candidates"),
    ("a million candidates", {**rank_body("x", 6), "candidates": [1] * 1_000_000}, 422, "candidates"),
    ("candidate id beyond the catalogue", {**rank_body("x", 6), "candidates": [1, 301]}, 422, "catalogue"),
    ("string item id", {**rank_body("x", 6), "candidates": ["7"]}, 422, "candidates.0"),
    ("float timestamp", {**rank_body("x", 6), "timestamp": 1.5}, 422, "timestamp"),
    ("user id is a list", {**rank_body("x", 6), "user_id": ["x"]}, 422, "user_id"),
    ("unknown field", {**rank_body("x", 6), "colour": "red"}, 422, "unknown field"),
    ("items/timestamps mismatch", {**rank_body("x", 6), "short_term": {"items": [1, 2], "timestamps": [1]}},
     422, "same length"),
    ("oversized body", b'{"user_id": "' + b"x" * (5 << 20) + b'"}', 413, "too large"),
]


@pytest.mark.parametrize(("name", "body", "status", "message"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
async def test_bad_requests_get_a_4xx_with_a_message_and_serving_continues(
        ranker: SimpleNamespace, name: str, body: dict | bytes, status: int, message: str) -> None:
    path = "/v1/rank"
    got, err = await post(ranker, path, body)
    assert got == status, err
    assert message in err["error"] and err["status"] == status
    got, _ = await post(ranker, "/v1/prefill", body if isinstance(body, bytes) else {"user_id": "x"})
    assert 400 <= got < 500
    ok, out = await post(ranker, "/v1/rank", rank_body("healthy", 7))
    assert ok == 200 and out["cache"] == "miss"


async def test_openapi_metrics_health_profile(ranker: SimpleNamespace) -> None:
    async with ranker.http.get(ranker.url + "/openapi.json") as resp:
        doc = await resp.json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/prefill", "/v1/rank", "/healthz", "/readyz", "/metrics"} <= set(doc["paths"])
    rank_op = doc["paths"]["/v1/rank"]["post"]
    assert rank_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/RankRequest")
    assert {"RankRequest", "RankResponse", "Events", "ErrorResponse"} <= set(doc["components"]["schemas"])
    assert "422" in rank_op["responses"] and "413" in rank_op["responses"]
    for path in ("/healthz", "/readyz"):
        async with ranker.http.get(ranker.url + path) as resp:
            assert resp.status == 200
    async with ranker.http.get(ranker.url + "/v1/profile") as resp:
        prof = await resp.json()
    assert prof["max_len"] == 48 and len(prof["full_ms"]) == len(prof["lengths"]) >= 2
    await post(ranker, "/v1/rank", rank_body("m", 8))
    async with ranker.http.get(ranker.url + "/metrics") as resp:
        text = await resp.text()
    assert 'grstack_ranker_requests_total{endpoint="/v1/rank",status="200"} 1.0' in text
    assert 'grstack_ranker_cache_lookups_total{result="miss"} 1.0' in text
    assert "grstack_ranker_cache_bytes" in text and "grstack_ranker_batch_size_bucket" in text


async def test_a_miss_computed_in_chunks_is_cached_for_the_next_visit(kit: SimpleNamespace) -> None:
    for cache_misses in (True, False):
        service = RankerService(kit.make_model(), ["next", "click"],
                                RankerConfig(max_suffix=8, chunk=8, cache_misses=cache_misses))
        runner, url = await start_ranker(service)
        try:
            async with aiohttp.ClientSession() as session:
                r = SimpleNamespace(service=service, url=url, http=session)
                body = rank_body("dora", 5)  # 30 long-term tokens: 4 chunks
                _, first = await post(r, "/v1/rank", body)
                later = {**body, "candidates": [7, 8, 9], "short_term": {"items": [11, 12],
                                                                          "timestamps": [body["timestamp"] + 1] * 2},
                         "timestamp": body["timestamp"] + 5}
                _, second = await post(r, "/v1/rank", later)  # the same long-term history, a later visit
                short = rank_body("eve", 6, n_long=6)  # fits one chunk: one full inference, no K/V kept
                await post(r, "/v1/rank", short)
                _, short_again = await post(r, "/v1/rank", short)
        finally:
            await runner.cleanup()
        assert first["cache"] == "miss" and short_again["cache"] == "miss"
        assert second["cache"] == ("device" if cache_misses else "miss")
        eng: RelayEngine = service.engine
        item = eng.canonical(later["long_term"]["items"], later["long_term"]["timestamps"],
                             later["short_term"]["items"], later["short_term"]["timestamps"], later["candidates"],
                             later["timestamp"])
        assert np.abs(np.array(second["scores"]) - eng.rank_encode([item])[0].numpy()).max() <= 1e-5

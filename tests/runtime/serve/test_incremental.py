"""Incremental prefixes: a cached older prefix of a user's new history is extended by the new events only —
exact like a full prefill — in the pre-infer signal and on the rank miss path; anything else prefills in full."""

from __future__ import annotations

import json
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker

pytestmark = pytest.mark.integration

TOL = 1e-5


def history(seed: int, n: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 301, n).tolist(), (1_600_000_000 + np.cumsum(rng.integers(1, 999, n))).tolist()


def body(user: str, items: list[int], ts: list[int], n_long: int, n_short: int = 4) -> dict:
    """The first ``n_long`` events as long-term history, the next ``n_short`` as short-term."""
    end = n_long + n_short
    return {"user_id": user, "long_term": {"items": items[:n_long], "timestamps": ts[:n_long]},
            "short_term": {"items": items[n_long:end], "timestamps": ts[n_long:end]},
            "candidates": [3, 1, 4, 1, 5], "timestamp": ts[end - 1] + 10}


def pre(rank: dict) -> dict:
    return {"user_id": rank["user_id"], "long_term": rank["long_term"]}


def oracle(eng: RelayEngine, b: dict) -> np.ndarray:
    item = eng.canonical(b["long_term"]["items"], b["long_term"]["timestamps"], b["short_term"]["items"],
                         b["short_term"]["timestamps"], b["candidates"], b["timestamp"])
    return eng.rank_encode([item])[0].numpy()


@pytest.fixture
async def ranker(kit: SimpleNamespace):
    # max_len 48, max_suffix 8: the prefix keeps the last 40 long-term events; chunk 8: extensions are chunked
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, chunk=8))
    runner, url = await start_ranker(service)
    async with aiohttp.ClientSession() as http:

        async def post(path: str, payload: dict) -> dict:
            async with http.post(url + path, data=json.dumps(payload).encode()) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()

        async def stats() -> dict:
            async with http.get(url + "/v1/stats") as resp:
                return await resp.json()

        yield SimpleNamespace(service=service, post=post, stats=stats, url=url, http=http)
    await runner.cleanup()


def test_extend_many_equals_extending_one_by_one_and_a_full_prefill(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    seqs = [history(s, n) for s, n in ((1, 30), (2, 17), (3, 9), (4, 25))]
    cut = [12, 0, 9, 20]  # base lengths: an empty base, and a base that is already the whole prefix
    arr = [(np.array(i, dtype=np.int64), np.array(t, dtype=np.int64)) for i, t in seqs]
    bases = [eng.prefill(i[:c], t[:c]) for (i, t), c in zip(arr, cut, strict=True)]
    out = eng.extend_many(bases, [i[c:] for (i, _), c in zip(arr, cut, strict=True)],
                          [t[c:] for (_, t), c in zip(arr, cut, strict=True)])
    for (i, t), kv in zip(arr, out, strict=True):
        full = eng.prefill(i, t)
        assert kv.length == len(i) and torch.equal(kv.timestamps, full.timestamps)
        for a, b in zip(kv.keys + kv.values, full.keys + full.values, strict=True):
            assert a.shape == b.shape and a.is_contiguous()
            assert torch.allclose(a, b, atol=TOL, rtol=0)


async def test_a_prefill_signal_extends_the_cached_older_prefix_exactly(ranker: SimpleNamespace) -> None:
    items, ts = history(7, 40)
    old, new = body("u", items, ts, 20), body("u", items, ts, 31)
    first = await ranker.post("/v1/prefill", pre(old))
    assert first["status"] == "computed" and first["reused_len"] == 0
    second = await ranker.post("/v1/prefill", pre(new))
    assert second["status"] == "computed" and second["reused_len"] == 20 and second["prefix_len"] == 31
    hit = await ranker.post("/v1/rank", new)
    assert hit["cache"] == "device" and hit["prefix_hash"] == second["prefix_hash"]
    assert np.abs(np.array(hit["scores"]) - oracle(ranker.service.engine, new)).max() <= TOL
    s = await ranker.stats()
    assert s["prefill_tokens_computed"] == 20 + 11
    assert s["prefill_tokens_without_incremental"] == 20 + 31
    assert s["incremental_prefills"] == 1
    assert s["device_entries"] == 1  # the new version replaced the old one


async def test_a_rank_miss_extends_an_older_prefix_ranks_exactly_and_caches_the_new_version(
        ranker: SimpleNamespace) -> None:
    items, ts = history(8, 44)
    await ranker.post("/v1/prefill", pre(body("m", items, ts, 15)))
    new = body("m", items, ts, 37)
    miss = await ranker.post("/v1/rank", new)
    assert miss["cache"] == "miss" and miss["reused_len"] == 15
    assert np.abs(np.array(miss["scores"]) - oracle(ranker.service.engine, new)).max() <= TOL
    again = await ranker.post("/v1/rank", new)
    assert again["cache"] == "device" and again["reused_len"] == 0
    assert np.abs(np.array(again["scores"]) - np.array(miss["scores"])).max() <= TOL
    s = await ranker.stats()
    assert s["prefill_tokens_computed"] == 15 + 22
    assert s["prefill_tokens_without_incremental"] == 15 + 37
    assert s["incremental_prefills"] == 1 and s["misses"] == 1 and s["device_hits"] == 1


async def test_an_edited_old_event_or_a_truncated_history_prefills_in_full(ranker: SimpleNamespace) -> None:
    items, ts = history(9, 60)
    await ranker.post("/v1/prefill", pre(body("e", items, ts, 20)))
    edited = list(items)
    edited[5] = edited[5] % 300 + 1
    changed = body("e", edited, ts, 28)
    r = await ranker.post("/v1/prefill", pre(changed))
    assert r["status"] == "computed" and r["reused_len"] == 0
    miss = await ranker.post("/v1/rank", body("e", edited, ts, 30))  # extends the edited version: exact
    assert miss["reused_len"] == 28
    # the cached prefix is now 30 events; 44 long-term events keep only the last 40: the oldest are gone
    await ranker.post("/v1/prefill", pre(body("e", edited, ts, 40)))  # 40 events: extends 30 -> 40
    long = body("e", edited, ts, 44)
    r = await ranker.post("/v1/prefill", pre(long))
    assert r["prefix_len"] == 40 and r["reused_len"] == 0
    hit = await ranker.post("/v1/rank", long)
    assert hit["cache"] == "device" and hit["truncated"] == 4
    assert np.abs(np.array(hit["scores"]) - oracle(ranker.service.engine, long)).max() <= TOL
    s = await ranker.stats()
    assert s["incremental_prefills"] == 2
    assert s["prefill_tokens_computed"] == 20 + 28 + 2 + 10 + 40
    assert s["prefill_tokens_without_incremental"] == 20 + 28 + 30 + 40 + 40


async def test_stats_report_capacities_queues_and_compute_time_by_kind(ranker: SimpleNamespace) -> None:
    items, ts = history(10, 40)
    b = body("s", items, ts, 30)
    await ranker.post("/v1/prefill", pre(b))
    await ranker.post("/v1/rank", b)
    await ranker.post("/v1/rank", {**b, "user_id": "other"})
    s = await ranker.stats()
    cfg = ranker.service.config
    assert s["device_capacity_bytes"] == cfg.device_cache_bytes and s["dram_capacity_bytes"] == cfg.dram_cache_bytes
    assert s["queue_depth"] == {"hits": 0, "misses": 0, "prefills": 0} and s["prefill_backlog_tokens"] == 0
    assert set(s["compute_ms_total"]) == {"prefill", "rank_cached", "rank_full"}
    assert all(v > 0 for v in s["compute_ms_total"].values())
    async with ranker.http.get(ranker.url + "/metrics") as resp:
        text = await resp.text()
    assert "grstack_ranker_prefill_tokens_total 60.0" in text
    assert "grstack_ranker_prefill_tokens_without_incremental_total 60.0" in text
    assert 'grstack_ranker_compute_seconds_total{kind="prefill"}' in text

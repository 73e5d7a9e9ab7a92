"""The two-tier prefix cache: device LRU by bytes, DRAM expander with TTL, single-flight promotion, versions."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.engine import PrefixKV
from grstack.runtime.serve.prefix import prefix_hash

pytestmark = pytest.mark.unit


def kv(n: int, fill: float = 0.0) -> PrefixKV:
    """A prefix of n tokens: 1 layer, [1, n, 2] keys and values (fp32) + int64 timestamps = 24 n bytes."""
    t = torch.full((1, n, 2), fill)
    return PrefixKV([t], [t.clone()], torch.arange(n))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def test_device_lru_evicts_to_dram_by_bytes() -> None:
    assert kv(10).nbytes == 240
    c = TieredKVCache(device_bytes=480, dram_bytes=10_000, dram_ttl_s=60)
    assert c.put("a", "v1", kv(10)) and c.put("b", "v1", kv(10))
    assert c.device_used == 480 and c.dram_used == 0
    assert (await c.lookup("a", "v1"))[1] == "device"  # a is now most recently used
    c.put("c", "v1", kv(10))  # over budget by one entry: the LRU one (b) moves to DRAM
    assert c.tier_of("b", "v1") == "dram" and c.tier_of("a", "v1") == "device"
    assert c.device_used == 480 and c.dram_used == 240
    assert c.stats.evictions_to_dram == 1


async def test_dram_entries_expire_after_ttl() -> None:
    clock = Clock()
    c = TieredKVCache(device_bytes=240, dram_bytes=10_000, dram_ttl_s=5, clock=clock)
    c.put("a", "v1", kv(10))
    c.put("b", "v1", kv(10))  # a -> DRAM at t=100, expires at 105
    clock.t = 104.999
    assert c.tier_of("a", "v1") == "dram"
    clock.t = 105.0
    assert c.tier_of("a", "v1") is None
    assert await c.lookup("a", "v1") == (None, None)
    assert c.dram_used == 0 and c.stats.dram_expired == 1


async def test_dram_budget_drops_oldest() -> None:
    c = TieredKVCache(device_bytes=240, dram_bytes=480, dram_ttl_s=60)
    for user in "abcd":
        c.put(user, "v1", kv(10))
    # d on the device; c, b in DRAM (480 bytes); a dropped
    assert [c.tier_of(u, "v1") for u in "abcd"] == [None, "dram", "dram", "device"]
    assert c.stats.dram_dropped == 1


async def test_promotion_is_single_flight_and_returns_to_device() -> None:
    calls = []

    async def slow_to_device(x: PrefixKV) -> PrefixKV:
        calls.append(x)
        await asyncio.sleep(0.05)
        return x

    c = TieredKVCache(device_bytes=240, dram_bytes=10_000, dram_ttl_s=60, to_device=slow_to_device)
    c.put("a", "v1", kv(10, fill=1.0))
    c.put("b", "v1", kv(10))  # a -> DRAM
    results = await asyncio.gather(*(c.lookup("a", "v1") for _ in range(5)))
    assert len(calls) == 1
    assert all(tier == "dram" and float(got.keys[0][0, 0, 0]) == 1.0 for got, tier in results)
    assert c.stats.promotions == 1 and c.stats.dram_hits == 5
    assert c.tier_of("a", "v1") == "device" and c.tier_of("b", "v1") == "dram"  # b made room for a
    assert (await c.lookup("a", "v1"))[1] == "device"


async def test_versions_replace_and_mismatch_misses() -> None:
    c = TieredKVCache(device_bytes=240, dram_bytes=10_000, dram_ttl_s=60)
    c.put("a", "v1", kv(10))
    c.put("b", "v1", kv(10))  # a/v1 -> DRAM
    c.put("a", "v2", kv(5))  # a new version drops v1 from DRAM
    assert c.tier_of("a", "v1") is None and c.tier_of("a", "v2") == "device"
    assert await c.lookup("a", "v1") == (None, None)
    assert c.dram_used + c.device_used == kv(10).nbytes + kv(5).nbytes


async def test_an_entry_larger_than_the_device_budget_is_not_cached() -> None:
    c = TieredKVCache(device_bytes=100, dram_bytes=10_000, dram_ttl_s=60)
    assert not c.put("a", "v1", kv(10))
    assert c.device_used == 0 and c.stats.rejected_too_large == 1


async def test_extendable_finds_a_cached_strict_prefix_in_either_tier_exactly() -> None:
    clock = Clock()
    c = TieredKVCache(device_bytes=240, dram_bytes=10_000, dram_ttl_s=60, clock=clock)
    items, ts = np.arange(1, 16), np.arange(15) * 10
    old = prefix_hash(items[:10], ts[:10])
    c.put("u", old, kv(10))
    assert c.extendable("u", items, ts) == old
    assert c.extendable("u", items[:10], ts[:10]) is None  # the same version: a hit, not an extension
    assert c.extendable("u", items[:9], ts[:9]) is None  # shorter
    edited = items.copy()
    edited[3] = 99
    assert c.extendable("u", edited, ts) is None  # an old event changed
    assert c.extendable("u", items[1:], ts[1:]) is None  # truncation dropped the oldest event
    assert c.extendable("other", items, ts) is None
    c.put("w", "x", kv(10))  # u moves to DRAM: still extendable there, until its TTL
    assert c.tier_of("u", old) == "dram" and c.extendable("u", items, ts) == old
    clock.t += 61
    assert c.extendable("u", items, ts) is None

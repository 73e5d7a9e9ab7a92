"""The server-local DRAM tier shared by a server's replicas: one byte budget and one TTL (on the injected
clock) over every replica's evictions, any replica promotes what another evicted, a new version from any
replica replaces the user's entry, and pooled host buffers go back to their pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.clock import ManualClock
from grstack.runtime.serve.dram_tier import DramTier
from grstack.runtime.serve.engine import PrefixKV
from grstack.runtime.serve.host_pool import HostPool, copy_to_host

pytestmark = pytest.mark.unit


def kv(n: int, fill: float = 0.0) -> PrefixKV:
    """n tokens: 1 layer, [1, n, 2] fp32 keys and values and int64 timestamps = 24 n bytes."""
    t = torch.full((1, n, 2), fill)
    return PrefixKV([t], [t.clone()], torch.arange(n))


def replicas(dram: DramTier, n: int = 2) -> list[TieredKVCache]:
    # each replica's device tier holds one 10-token prefix (240 B)
    return [TieredKVCache(240, 0, 0.0, clock=dram.clock, dram=dram) for _ in range(n)]


async def test_a_prefix_evicted_by_one_replica_is_promoted_by_another() -> None:
    dram = DramTier(10_000, 60.0, ManualClock(0.0))
    a, b = replicas(dram)
    assert a.dram_bytes == 10_000 and a.dram_ttl_s == 60.0  # the shared tier's budget and TTL apply
    a.put("u", "v1", kv(10, 1.0))
    a.put("w", "v1", kv(10))  # u evicted to the server's DRAM
    assert b.tier_of("u", "v1") == "dram" and a.dram_used == b.dram_used == 240
    got, tier = await b.lookup("u", "v1")
    assert tier == "dram" and got is not None and float(got.keys[0][0, 0, 0]) == 1.0
    assert b.tier_of("u", "v1") == "device" and dram.used_bytes == 0 and len(dram) == 0
    assert (await a.lookup("u", "v1")) == (None, None)  # taken: a holds it no more


async def test_one_budget_over_every_replicas_evictions_oldest_dropped_first() -> None:
    dram = DramTier(480, 60.0, ManualClock(0.0))  # two entries
    a, b = replicas(dram)
    a.put("u1", "v", kv(10))
    a.put("u2", "v", kv(10))  # u1 -> DRAM
    b.put("u3", "v", kv(10))
    b.put("u4", "v", kv(10))  # u3 -> DRAM
    a.put("u5", "v", kv(10))  # u2 -> DRAM: over the budget, u1 (the oldest) is dropped
    assert [c.tier_of(u, "v") for c, u in ((a, "u1"), (a, "u2"), (b, "u3"))] == [None, "dram", "dram"]
    assert dram.used_bytes == 480 and dram.dropped == 1 and a.stats.dram_dropped == 1


async def test_the_shared_ttl_runs_on_the_injected_clock() -> None:
    clock = ManualClock(0.0)
    dram = DramTier(10_000, 5.0, clock)
    a, b = replicas(dram)
    a.put("u", "v", kv(10))
    a.put("w", "v", kv(10))
    clock.advance(4.999)
    assert b.tier_of("u", "v") == "dram"
    clock.advance(0.001)
    assert b.tier_of("u", "v") is None
    assert b.expire() == 1 and dram.used_bytes == 0 and dram.expired == 1 and b.stats.dram_expired == 1


async def test_a_new_version_from_any_replica_replaces_the_users_entry() -> None:
    dram = DramTier(10_000, 60.0, ManualClock(0.0))
    a, b = replicas(dram)
    a.put("u", "v1", kv(10))
    a.put("w", "v1", kv(10))
    assert dram.get("u") is not None
    b.put("u", "v2", kv(10))  # b stores a newer prefix of u: the old DRAM version is gone
    assert a.tier_of("u", "v1") is None and dram.get("u") is None and dram.used_bytes == 0


def test_dropping_an_entry_gives_its_pooled_buffer_back() -> None:
    clock = ManualClock(0.0)
    dram = DramTier(10_000, 1.0, clock)
    pool = HostPool(1 << 20)
    x = kv(10, 3.0)
    dram.put("u", "v", copy_to_host(x, pool), x.nbytes)
    assert pool.free_bytes == 0 and pool.owned_bytes > 0
    clock.advance(1.0)
    assert dram.expire() == 1 and pool.free_bytes == pool.owned_bytes
    too_big = copy_to_host(kv(1000), pool)
    assert dram.put("u", "v", too_big, 24_000) == 1 and len(dram) == 0  # refused: released at once
    assert pool.free_bytes == pool.owned_bytes


async def test_extendable_sees_a_strict_prefix_another_replica_evicted() -> None:
    from grstack.runtime.serve.prefix import prefix_hash

    dram = DramTier(10_000, 60.0, ManualClock(0.0))
    a, b = replicas(dram)
    items, ts = np.arange(1, 21), np.arange(100, 120)
    a.put("u", prefix_hash(items[:10], ts[:10]), kv(10))
    a.put("w", "x", kv(10))
    assert b.extendable("u", items, ts) == prefix_hash(items[:10], ts[:10])


async def test_two_rankers_in_one_process_share_the_servers_dram(kit) -> None:
    from grstack.runtime.serve.ranker import RankerConfig, RankerService
    from grstack.runtime.serve.schemas import PrefillRequest, RankRequest

    model = kit.make_model()
    per_token = model.kv_elements_per_token * 4 + 8
    dram = DramTier(1 << 24, 60.0, ManualClock(0.0))
    cfg = RankerConfig(max_suffix=8, chunk=8, kv_arena=False, device_cache_bytes=40 * per_token)  # one prefix
    a, b = (RankerService(model, ["next", "click"], cfg, dram=dram, clock=dram.clock) for _ in range(2))
    for s in (a, b):
        s.scheduler.start()
    try:
        rng = np.random.default_rng(5)

        def body(user: str) -> dict:
            items, ts = rng.integers(1, 300, 36), 1_600_000_000 + np.cumsum(rng.integers(1, 5000, 36))
            return dict(user_id=user, long_term={"items": items[:30].tolist(), "timestamps": ts[:30].tolist()},
                        short_term={"items": items[30:].tolist(), "timestamps": ts[30:].tolist()},
                        candidates=[7, 8, 9], timestamp=int(ts[-1]) + 1)

        u, w = body("u"), body("w")
        for req in (u, w):  # a computes both: u is evicted to the server's DRAM
            assert (await a.prefill(PrefillRequest(user_id=req["user_id"], long_term=req["long_term"]))).status \
                == "computed"
        assert a.cache.entries("dram") == b.cache.entries("dram") == 1
        res = await b.rank(RankRequest(**u))
        assert res.cache == "dram"  # promoted on b, not recomputed
        eng = b.engine
        full = eng.rank_encode([eng.canonical(u["long_term"]["items"], u["long_term"]["timestamps"],
                                              u["short_term"]["items"], u["short_term"]["timestamps"],
                                              u["candidates"], u["timestamp"])])[0]
        np.testing.assert_allclose(np.array(res.scores), full.numpy(), atol=1e-5)
    finally:
        for s in (a, b):
            await s.scheduler.stop()

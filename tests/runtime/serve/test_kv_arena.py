"""The per-replica KV arena: allocator (first fit, coalescing, compaction around pinned blocks), in-place
prefill equal to the concatenating one, the cache's device tier in the arena (eviction copies out, promotion
copies into a fresh range, reservations evict LRU), and a ranker with the arena scoring as full inference."""

from __future__ import annotations

import asyncio
import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from grstack.kernels import PrefixLayout
from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.engine import PrefixKV, RelayEngine
from grstack.runtime.serve.kv_arena import ArenaKV, KVArena
from grstack.runtime.serve.ranker import RankerConfig, RankerService
from grstack.runtime.serve.scheduler import ComputeScheduler
from grstack.runtime.serve.schemas import PrefillRequest, RankRequest

pytestmark = pytest.mark.unit


def history(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 300, n), 1_600_000_000 + np.cumsum(rng.integers(1, 5000, n))


def close(a: PrefixKV, b: PrefixKV) -> None:
    assert a.length == b.length
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert torch.equal(a.timestamps, b.timestamps)


# -- allocator ----------------------------------------------------------------------------------------------

def test_first_fit_coalesces_freed_neighbours(kit) -> None:
    arena = KVArena(kit.make_model(), 100)
    a, b, c = arena.alloc(30), arena.alloc(30), arena.alloc(30)
    assert (a.start, b.start, c.start) == (0, 30, 60) and arena.free_ranges() == [(90, 10)]
    assert arena.alloc(11) is None
    arena.release(a)
    arena.release(c)
    assert arena.free_ranges() == [(0, 30), (60, 40)]
    assert arena.alloc(35).start == 60  # first range that fits
    arena.release(b)  # merges with the free range before it
    assert arena.free_ranges() == [(0, 60), (95, 5)]


def test_compaction_moves_unpinned_blocks_and_keeps_their_contents(kit) -> None:
    arena = KVArena(kit.make_model(), 60)
    blocks = [arena.alloc(10) for _ in range(6)]
    for i, blk in enumerate(blocks):  # mark each block's K/V and timestamps with its index
        kv = arena.prefix(blk, 10)
        for t in (*kv.keys, *kv.values):
            t.fill_(float(i))
        kv.timestamps.fill_(i)
    for i in (0, 2, 4):
        arena.release(blocks[i])
    assert arena.pin(blocks[3])  # compute reads block 3: it must not move
    assert arena.alloc(20) is None and arena.free_tokens == 30
    moved = arena.compact()
    assert blocks[3].start == 30 and blocks[1].start == 0 and blocks[5].start == 40
    assert moved == 20 and arena.free_ranges() == [(10, 20), (50, 10)]
    for i in (1, 3, 5):
        kv = arena.prefix(blocks[i], 10)
        assert all(bool((t == i).all()) for t in (*kv.keys, *kv.values, kv.timestamps))
    assert arena.alloc(20).start == 10
    arena.unpin(blocks[3])
    assert blocks[3].live  # still held by its owner


def test_freed_block_is_stale_and_not_pinnable(kit) -> None:
    arena = KVArena(kit.make_model(), 10)
    blk = arena.alloc(4)
    kv = arena.prefix(blk, 4)
    kv.release()
    assert not kv.live and not kv.pin()
    with pytest.raises(RuntimeError):
        arena.release(blk)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 1000)), max_size=40))
def test_allocator_invariants(kit, ops) -> None:
    """Random allocations, frees and compactions: ranges never overlap, free + held = capacity, the free list
    is sorted and coalesced, and an allocation fails only when no free range is large enough."""
    arena = KVArena(kit.make_model(), 97)
    held: list = []
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            blk = arena.alloc(n)
            if blk is None:
                assert arena.largest_free() < n
                if arena.free_tokens >= n:
                    arena.compact()
                    blk = arena.alloc(n)
                    assert blk is not None  # nothing is pinned: compaction leaves one free range
            if blk is not None:
                held.append(blk)
        else:
            arena.release(held.pop(pick % len(held)))
        free = arena.free_ranges()
        assert free == sorted(free) and all(n > 0 for _, n in free)
        assert all(s0 + n0 < s1 for (s0, n0), (s1, _) in itertools.pairwise(free))  # coalesced
        spans = sorted([(b.start, b.capacity) for b in held if b.capacity] + free)
        assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in itertools.pairwise(spans))
        assert sum(n for _, n in free) + sum(b.capacity for b in held) == 97


# -- engine -------------------------------------------------------------------------------------------------

def test_prefill_in_place_equals_concatenating_prefill_without_cat(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=16)
    arena = KVArena(eng.model, 300, backend=eng.backend)
    items, ts = history(100)
    want = eng.prefill(items, ts)
    arena.alloc(13)  # something before it: the range does not start at 0
    with mock.patch.object(PrefixLayout, "cat", side_effect=AssertionError("concatenated")):
        got = eng.prefill(items, ts, arena.prefix(arena.alloc(100)))
    assert isinstance(got, ArenaKV) and got.block.start == 13
    close(got, want)
    # a batched chunk step mixing an arena prefix and a plain one
    kvs = [arena.prefix(arena.alloc(48)), eng.empty_prefix()]
    for s in range(0, 48, 16):
        kvs = eng.extend_many(kvs, [items[s:s + 16]] * 2, [ts[s:s + 16]] * 2)
    assert isinstance(kvs[0], ArenaKV) and kvs[0].room == 0 and not isinstance(kvs[1], ArenaKV)
    close(kvs[0], eng.prefill(items[:48], ts[:48]))
    close(kvs[1], eng.prefill(items[:48], ts[:48]))


def test_rank_from_arena_views_equals_rank_from_own_tensors(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=32)
    arena = KVArena(eng.model, 400, backend=eng.backend)
    reqs, plain, views = [], [], []
    for u, n in enumerate((60, 5, 90)):
        items, ts = history(n + 4, seed=u)
        reqs.append(eng.canonical(items[:n], ts[:n], items[n:], ts[n:], [1, 2, 3, 4], int(ts[-1]) + 1))
        plain.append(eng.prefill(reqs[-1].long_items, reqs[-1].long_ts))
        arena.alloc(7)  # gaps between the ranges
        views.append(eng.prefill(reqs[-1].long_items, reqs[-1].long_ts, arena.prefix(arena.alloc(n))))
    order = [2, 0, 1]  # out of arena order
    got = eng.rank_cached([views[i] for i in order], [reqs[i] for i in order])
    want = eng.rank_cached([plain[i] for i in order], [reqs[i] for i in order])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


# -- cache --------------------------------------------------------------------------------------------------

async def test_cache_device_tier_in_the_arena(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=32)
    arena = KVArena(eng.model, 100, backend=eng.backend)
    cache = TieredKVCache(arena.capacity_bytes, 1 << 30, 60.0, to_host=lambda kv: kv.to("cpu"), arena=arena)
    items, ts = history(40)
    want = eng.prefill(items, ts)
    assert cache.put("a", "v1", want)  # plain tensors are copied into a range
    a = (await cache.lookup("a", "v1"))[0]
    assert isinstance(a, ArenaKV) and cache.device_used == 40 * arena.bytes_per_token
    close(a, want)
    b = cache.reserve(40)
    assert b is not None and b.length == 0 and b.room == 40
    # no range of 40 is left: the LRU entry (a) is copied out to DRAM and its range freed
    c = cache.reserve(40)
    assert c is not None and cache.tier_of("a", "v1") == "dram" and not a.live
    for t in (*c.keys, *c.values):  # the freed range is reused and overwritten ...
        t.zero_()
    b.release()
    kv, tier = await cache.lookup("a", "v1")  # ... yet the DRAM copy is intact, promoted into a fresh range
    assert tier == "dram" and isinstance(kv, ArenaKV) and kv.live
    close(kv, want)
    assert cache.reserve(101) is None  # larger than the arena


async def test_reserve_compacts_when_free_tokens_are_scattered(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=32)
    arena = KVArena(eng.model, 90, backend=eng.backend)
    cache = TieredKVCache(arena.capacity_bytes, 1 << 30, 60.0, arena=arena)
    prefixes = {}
    for u in "abc":
        items, ts = history(30, seed=ord(u))
        prefixes[u] = eng.prefill(items, ts)
        cache.put(u, "v", prefixes[u])
    cache._drop("a")  # frees the first and the last range: 60 tokens free, 30 at most in one range
    arena.release(arena.alloc(0))  # a zero-length block changes nothing
    cache._drop("c")
    assert arena.free_tokens == 60 and arena.largest_free() == 30
    got = cache.reserve(45)
    assert got is not None and arena.compactions == 1 and cache.entries("device") == 1
    b = (await cache.lookup("b", "v"))[0]
    assert b.block.start == 0 and got.block.start == 30
    close(b, prefixes["b"])  # moved, contents kept


async def test_pinned_hit_survives_eviction_until_its_rank_ran(kit) -> None:
    """A rank queued on an arena prefix holds its range: evicting the entry meanwhile cannot hand the range
    to a new prefill before the rank has read it."""
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=32)
    arena = KVArena(eng.model, 60, backend=eng.backend)
    cache = TieredKVCache(arena.capacity_bytes, 1 << 30, 60.0, to_host=lambda kv: kv.to("cpu"), arena=arena)
    sched = ComputeScheduler(eng, reserve=cache.reserve)
    items, ts = history(50)
    cache.put("a", "v", eng.prefill(items[:40], ts[:40]))
    kv = (await cache.lookup("a", "v"))[0]
    item = eng.canonical(items[:40], ts[:40], items[40:], ts[40:], [5, 6], int(ts[-1]) + 1)
    want = eng.rank_cached([eng.prefill(items[:40], ts[:40])], [item])[0]
    sched.start()
    try:
        rank = asyncio.ensure_future(sched.rank_cached(kv, item))
        await asyncio.sleep(0)
        assert kv.block.pins == 1
        # a prefill of another user needs 50 tokens: the cache evicts a, but its range stays held
        prefill = sched.submit_prefill(*history(50, seed=9))
        got, _ = await rank
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        new_kv, _ = await prefill
        assert not isinstance(new_kv, ArenaKV)  # no range could be had while a's was held: computed aside
        assert kv.block.pins == 0 and not kv.live and arena.free_tokens == 60
    finally:
        await sched.stop()


# -- ranker -------------------------------------------------------------------------------------------------

async def test_ranker_with_arena_scores_as_full_inference(kit) -> None:
    model = kit.make_model()
    service = RankerService(model, ["next", "click"],
                            RankerConfig(max_suffix=8, chunk=8, kv_arena=True, device_cache_bytes=1 << 20))
    assert service.arena is not None
    service.scheduler.start()
    try:
        items, ts = history(40, seed=3)
        body = dict(user_id="u", long_term={"items": items[:30].tolist(), "timestamps": ts[:30].tolist()},
                    short_term={"items": items[30:].tolist(), "timestamps": ts[30:].tolist()},
                    candidates=[7, 8, 9], timestamp=int(ts[-1]) + 1)
        pre = await service.prefill(PrefillRequest(user_id="u", long_term=body["long_term"]))
        assert pre.status == "computed"
        cached = await service.rank(RankRequest(**body))
        assert cached.cache == "device"
        e = service.cache._device["u"]
        assert isinstance(e.kv, ArenaKV) and e.kv.block.pins == 0 and e.kv.block.refs == 1
        longer = dict(body, long_term={"items": items[:36].tolist(), "timestamps": ts[:36].tolist()},
                      short_term={"items": items[36:].tolist(), "timestamps": ts[36:].tolist()})
        ext = await service.rank(RankRequest(**longer))  # incremental: base copied into a new range once
        assert ext.reused_len == 30 and not e.kv.live
        eng = service.engine
        for b, res in ((body, cached), (longer, ext)):
            full = eng.rank_encode([eng.canonical(b["long_term"]["items"], b["long_term"]["timestamps"],
                                                  b["short_term"]["items"], b["short_term"]["timestamps"],
                                                  b["candidates"], b["timestamp"])])[0]
            np.testing.assert_allclose(np.array(res.scores), full.numpy(), atol=1e-5)
        assert service.arena.used_tokens == 36  # only the current version is held
        metrics = generate_latest(service.metrics.registry).decode()
        assert 'grstack_ranker_kv_arena_tokens{state="used"} 36.0' in metrics
    finally:
        await service.scheduler.stop()


async def test_a_miss_uses_free_room_but_never_evicts_for_it(kit) -> None:
    """A rank miss's prefix is not cached: it is computed in a free arena range (released afterwards) when one
    is there, and aside otherwise — cached prefixes are not evicted for it."""
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=16)
    arena = KVArena(eng.model, 100, backend=eng.backend)
    cache = TieredKVCache(arena.capacity_bytes, 1 << 30, 60.0, arena=arena)
    sched = ComputeScheduler(eng, reserve=cache.reserve)
    items, ts = history(70, seed=4)
    item = eng.canonical(items[:60], ts[:60], items[60:], ts[60:], [5, 6], int(ts[-1]) + 1)
    want = eng.rank_encode([item])[0]
    reserved = []
    real = cache.reserve
    cache.reserve = lambda *a, **kw: reserved.append(r := real(*a, **kw)) or r  # type: ignore[method-assign]
    sched.reserve = cache.reserve
    sched.start()
    try:
        got, _ = await sched.rank_full(item)  # 100 tokens free: computed in the arena
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert isinstance(reserved[-1], ArenaKV) and arena.free_tokens == 100
        cache.put("a", "v", eng.prefill(*history(50, seed=5)))
        got, _ = await sched.rank_full(item)  # 50 free < 60: aside, and "a" stays on the device
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert reserved[-1] is None and cache.tier_of("a", "v") == "device" and arena.free_tokens == 50
    finally:
        await sched.stop()

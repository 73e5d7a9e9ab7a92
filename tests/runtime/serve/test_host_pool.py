"""The reused host pool behind DRAM-tier evictions: size classes, reuse, the byte bound, buffers never given
back, and a cache whose evictions and promotions cycle through the pool without allocating (on CPU, where the
pool is plain memory and the same path runs)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.serve.host_pool import HostPool, PooledKV, copy_to_host, evict_to_host, size_class
from grstack.runtime.serve.kv_arena import KVArena

pytestmark = pytest.mark.unit


def history(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 300, n), 1_600_000_000 + np.cumsum(rng.integers(1, 5000, n))


@pytest.mark.parametrize("n", [1, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 1, 123_456_789])
def test_size_class_covers_the_request_and_wastes_at_most_an_eighth(n: int) -> None:
    c = size_class(n)
    assert c >= n and (c <= 4096 or c - n < c / 8 + 1)
    assert size_class(c) == c


def test_a_given_back_buffer_is_handed_out_again() -> None:
    pool = HostPool(1 << 20)
    for _ in range(5):
        buf, wait = pool.take(10_000)
        assert buf.numel() >= 10_000 and wait is None and not buf.is_pinned()
        pool.give(buf)
    assert pool.stats.allocations == 1 and pool.stats.reuses == 4
    assert pool.owned_bytes == pool.free_bytes == size_class(10_000)
    pool.give(buf)  # twice: ignored
    assert pool.free_bytes == size_class(10_000)


def test_the_pool_owns_at_most_its_capacity() -> None:
    pool = HostPool(3 * 8192)
    bufs = [pool.take(8192)[0] for _ in range(4)]  # the 4th is beyond the bound: served, counted
    assert pool.stats.overflows == 1
    for b in bufs:
        pool.give(b)
    assert pool.owned_bytes <= pool.capacity_bytes and pool.free_bytes == 3 * 8192
    big, _ = pool.take(20_000)  # another class: free buffers are dropped to make room
    assert pool.owned_bytes <= pool.capacity_bytes and pool.stats.overflows == 1
    pool.give(big)


def test_a_buffer_never_given_back_is_accounted_when_collected() -> None:
    pool = HostPool(1 << 20)
    buf, _ = pool.take(5000)
    assert pool.owned_bytes == size_class(5000)
    del buf
    gc.collect()
    assert pool.owned_bytes == 0 and pool.stats.lost == 1


def test_copy_to_host_carves_every_tensor_out_of_one_buffer(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=16)
    kv = eng.prefill(*history(50))
    pool = HostPool(1 << 24)
    host = copy_to_host(kv, pool)
    assert isinstance(host, PooledKV) and host.length == 50
    for a, b in zip((*host.keys, *host.values, host.timestamps), (*kv.keys, *kv.values, kv.timestamps),
                    strict=True):
        assert torch.equal(a, b) and a.untyped_storage().data_ptr() == host.buf.untyped_storage().data_ptr()
    host.release()
    host.release()
    assert pool.free_bytes == pool.owned_bytes > 0


async def test_evictions_and_promotions_cycle_through_the_pool_without_allocating(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8, chunk=32)
    arena = KVArena(eng.model, 100, backend=eng.backend)
    pool = HostPool(1 << 24)
    cache = TieredKVCache(arena.capacity_bytes, 1 << 24, 60.0, to_host=evict_to_host(pool), arena=arena)
    kvs = {u: eng.prefill(*history(60, seed=i)) for i, u in enumerate("abc")}
    for u, kv in kvs.items():
        cache.put(u, "v", kv)  # one fits the arena: each put evicts the previous one into the pool
    assert cache.tier_of("a", "v") == cache.tier_of("b", "v") == "dram"
    warm = 0
    for i, u in enumerate("abcabcabcabc"):  # each promotion evicts another: a copy out, a copy in, one given back
        got, _ = await cache.lookup(u, "v")
        assert got is not None
        for x, y in zip((*got.keys, *got.values), (*kvs[u].keys, *kvs[u].values), strict=True):
            assert torch.equal(x, y)
        if i == 2:  # warm: every user's prefix evicted once, and one more held while its promotion copies in
            warm = pool.stats.allocations
            assert warm == 3
    assert pool.stats.allocations == warm and pool.stats.reuses >= 9
    cache._drop("a")
    cache._drop("b")
    cache._drop("c")
    assert pool.free_bytes == pool.owned_bytes  # every buffer back


def test_a_plain_host_prefix_is_kept_as_it_is(kit) -> None:
    eng = RelayEngine(kit.make_model(max_len=120), max_suffix=8)
    kv = eng.prefill(*history(10))
    pool = HostPool(1 << 20)
    assert evict_to_host(pool)(kv) is kv and pool.stats.allocations == 0

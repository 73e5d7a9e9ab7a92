"""Device-tier eviction: LRU by default and as the degenerate case of the cost-aware policy, which evicts the
entry cheapest to get back per byte and least recently used (on a ManualClock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.clock import ManualClock
from grstack.runtime.serve.engine import PrefixKV
from grstack.runtime.serve.eviction import choose_victim, recompute_seconds

pytestmark = pytest.mark.unit


def kv(n: int) -> PrefixKV:
    """n tokens, 24 n bytes (1 layer of [1, n, 2] fp32 keys and values, int64 timestamps)."""
    t = torch.zeros((1, n, 2))
    return PrefixKV([t], [t.clone()], torch.arange(n))


def quadratic(n: int) -> float:  # attention over the prefix: a long prefix is dearer per byte
    return 1e-6 * n * n


def filled(clock: ManualClock, cost: object) -> TieredKVCache:
    """A 600-byte device tier holding long (20 tokens, put at t=0) and short (5 tokens, put at t=1)."""
    c = TieredKVCache(600, 10_000, 60.0, clock=clock, evict_cost_s=cost)  # type: ignore[arg-type]
    c.put("long", "v", kv(20))
    clock.advance(1.0)
    c.put("short", "v", kv(5))
    clock.advance(1.0)
    return c


@pytest.mark.parametrize(("cost", "evicted"), [(None, "long"), (lambda n: 1e-3 * n, "long"),
                                               (quadratic, "short")])
def test_the_victim_is_the_cheapest_per_byte_and_least_recent(cost: object, evicted: str) -> None:
    clock = ManualClock(0.0)
    c = filled(clock, cost)
    c.put("new", "v", kv(5))  # 720 bytes > 600: one entry goes to DRAM
    assert c.tier_of(evicted, "v") == "dram"
    kept = ({"long", "short"} - {evicted}).pop()
    assert c.tier_of(kept, "v") == "device"


async def test_a_recent_hit_protects_an_entry_cheap_per_byte() -> None:
    clock = ManualClock(0.0)
    c = filled(clock, quadratic)
    clock.advance(10.0)
    assert (await c.lookup("short", "v"))[1] == "device"  # short was just used; long is 12 s old
    clock.advance(0.01)
    c.put("new", "v", kv(5))
    assert c.tier_of("long", "v") == "dram" and c.tier_of("short", "v") == "device"


def test_only_the_oldest_candidates_are_scanned() -> None:
    entries = [("old", SimpleNamespace(nbytes=100, used=0.0, tokens=10)),
               ("cheap", SimpleNamespace(nbytes=100, used=1.0, tokens=1))]
    assert choose_victim(entries, 2.0, quadratic, candidates=2) == "cheap"
    assert choose_victim(entries, 2.0, quadratic, candidates=1) == "old"
    assert choose_victim(entries, 2.0, None) == "old"
    assert choose_victim([], 2.0, quadratic) is None


def test_recompute_seconds_reads_the_profile_once_measured() -> None:
    profile: list[object] = [None]
    cost = recompute_seconds(lambda: profile[0])
    assert cost(300) == 300.0  # before the profile: proportional to length (LRU)
    profile[0] = SimpleNamespace(lengths=[100, 1000], full_ms=[1.0, 10.0], cached_ms=[1.0, 1.0],
                                 prefill_ms=[2.0, 20.0], kv_bytes_per_token=8)
    assert cost(550) == pytest.approx(0.011)  # interpolated prefill ms, in seconds


def test_the_ranker_refuses_an_unknown_eviction_policy(kit) -> None:
    from grstack.runtime.serve.ranker import RankerConfig, RankerService

    with pytest.raises(ValueError, match="eviction"):
        RankerService(kit.make_model(), ["next", "click"], RankerConfig(eviction="lfu"))
    service = RankerService(kit.make_model(), ["next", "click"], RankerConfig(max_suffix=8, eviction="cost"))
    assert service.cache.evict_cost_s is not None and service.cache.evict_cost_s(10) == 10.0

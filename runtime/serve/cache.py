"""Two-tier prefix KV cache: device memory (byte budget, LRU) and a host-DRAM expander (byte budget, TTL).

Entries are keyed by user and versioned by the hash of the prefix they hold: a user has at most one entry,
and storing a new version drops the old one from both tiers. Entries evicted from the device tier move to
DRAM; a later lookup promotes them back to the device exactly once even when many requests ask at the same
time (single-flight: the others await the same promotion). Used from one asyncio event loop only.

With a KV arena (``arena``, :mod:`grstack.runtime.serve.kv_arena`) the device tier is the arena: an entry
is a token range of it (bytes = tokens x bytes per token), :meth:`TieredKVCache.reserve` hands out ranges
(evicting device entries LRU to DRAM until one fits, compacting when enough tokens are free but scattered),
an evicted entry is copied out to host memory and its range freed, and a promoted one is copied into a fresh
range.

The DRAM tier is a :class:`grstack.runtime.serve.dram_tier.DramTier`: the cache makes its own from
``dram_bytes``/``dram_ttl_s``, or is given one that the replicas of a server share (``dram``; its budget and TTL
then apply). A prefix another replica evicted there is promoted by whichever replica asks for it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from grstack.runtime.serve.clock import Now, SystemClock
from grstack.runtime.serve.dram_tier import DramTier
from grstack.runtime.serve.engine import PrefixKV
from grstack.runtime.serve.eviction import choose_victim
from grstack.runtime.serve.kv_arena import ArenaKV, KVArena
from grstack.runtime.serve.prefix import prefix_hash

Tier = Literal["device", "dram"]


@dataclass
class CacheStats:
    device_hits: int = 0
    dram_hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions_to_dram: int = 0
    dram_expired: int = 0
    dram_dropped: int = 0
    rejected_too_large: int = 0


@dataclass
class _Entry:
    version: str
    kv: PrefixKV
    nbytes: int
    used: float = 0.0  # clock of the last put or hit (cost-aware eviction)

    @property
    def tokens(self) -> int:
        return self.kv.length


@dataclass
class TieredKVCache:
    """``lookup``/``put`` by (user, version). ``to_host``/``to_device`` move tensors between tiers."""

    device_bytes: int
    dram_bytes: int
    dram_ttl_s: float
    to_host: Callable[[PrefixKV], PrefixKV] = lambda kv: kv
    to_device: Callable[[PrefixKV], Awaitable[PrefixKV]] | None = None
    clock: Now = field(default_factory=SystemClock)  # DRAM TTLs; the ranker passes its own
    stats: CacheStats = field(default_factory=CacheStats)
    arena: KVArena | None = None  # the device tier's storage (device_bytes should be its capacity_bytes)
    head: int = 0  # contextual tokens at the start of every prefix (a model with user context), not events
    dram: DramTier | None = None  # a DRAM tier shared with other replicas (None: this cache's own)
    # seconds to get a prefix of n tokens back: device evictions prefer the cheapest per byte and least recent
    # (runtime/serve/eviction.py); None: LRU
    evict_cost_s: Callable[[int], float] | None = None
    evict_candidates: int = 64  # the least recently used entries the cost-aware choice scans

    def __post_init__(self) -> None:
        self._device: OrderedDict[str, _Entry] = OrderedDict()
        self._promoting: dict[tuple[str, str], asyncio.Future[PrefixKV | None]] = {}
        self.device_used = 0
        if self.dram is None:
            self.dram = DramTier(self.dram_bytes, self.dram_ttl_s, self.clock)
        else:
            self.dram_bytes, self.dram_ttl_s = self.dram.capacity_bytes, self.dram.ttl_s
        self._dram: DramTier = self.dram

    @property
    def dram_used(self) -> int:
        """Bytes held by the DRAM tier (all its replicas' entries when it is shared)."""
        return self._dram.used_bytes

    # -- inspection ---------------------------------------------------------------------------------
    def tier_of(self, user: str, version: str) -> Tier | None:
        e = self._device.get(user)
        if e is not None and e.version == version:
            return "device"
        d = self._dram.get(user)
        if d is not None and d.version == version:
            return "dram"
        return None

    def extendable(self, user: str, items: np.ndarray, timestamps: np.ndarray, actions: np.ndarray | None = None,
                   context: bytes | None = None) -> str | None:
        """The version of ``user``'s cached prefix (either tier) when it is a strict prefix of the events
        ``items``/``timestamps`` (with their ``actions`` and the user's ``context`` key when the model reads
        them; decided exactly: the hash of the new history's first ``P`` events equals the cached version, ``P``
        the cached prefix's events), else None. Such an entry can be extended by the new events instead of
        prefilling from scratch."""
        for e in (self._device.get(user), self._dram.get(user)):
            if e is None:
                continue
            p = e.kv.length - self.head
            if 0 < p < len(items) and prefix_hash(items[:p], timestamps[:p],
                                                  actions[:p] if actions is not None else None,
                                                  context) == e.version:
                return e.version
        return None

    def entries(self, tier: Tier) -> int:
        return len(self._device) if tier == "device" else len(self._dram)

    # -- mutation -----------------------------------------------------------------------------------
    def put(self, user: str, version: str, kv: PrefixKV) -> bool:
        """Stores (replacing any other version of the user); False when it exceeds the device budget."""
        self._drop(user)
        nbytes = kv.nbytes
        if nbytes > self.device_bytes:
            self.stats.rejected_too_large += 1
            kv.release()
            return False
        if self.arena is not None and not (isinstance(kv, ArenaKV) and kv.arena is self.arena):
            stored = self.reserve(kv.length, kv)  # plain tensors (a promotion, a fallback) are copied in
            if stored is None:
                self.stats.rejected_too_large += 1
                return False
            kv = stored
        self._device[user] = _Entry(version, kv, nbytes, self.clock())
        self.device_used += nbytes
        self._evict_device()
        return True

    def reserve(self, tokens: int, base: PrefixKV | None = None, *, evict: bool = True) -> PrefixKV | None:
        """An arena range of ``tokens`` whose first ``base.length`` tokens hold ``base``'s K/V (empty without
        one), for a prefill to write its chunks into; the caller holds it (caches it with :meth:`put` or
        releases it). Device entries are evicted LRU (to DRAM) until a range fits (``evict``: for work whose
        result is cached, not for a transient one), compacting the arena when enough tokens are free but
        scattered; None without an arena or when no range can be had."""
        arena = self.arena
        if arena is None or tokens > arena.capacity:
            return None
        held = base is not None and base.pin()  # neither freed nor moved while ranges are made
        try:
            while True:
                block = arena.alloc(tokens)
                if block is None and arena.free_tokens >= tokens:
                    arena.compact()
                    block = arena.alloc(tokens)
                if block is not None:
                    return arena.store(block, base) if base is not None else arena.prefix(block)
                if not evict or not self._device:
                    return None
                self._evict_one()
        finally:
            if held:
                base.unpin()  # type: ignore[union-attr]

    def _drop(self, user: str) -> None:
        e = self._device.pop(user, None)
        if e is not None:
            self.device_used -= e.nbytes
            e.kv.release()
        self._dram.drop(user)  # a host copy gives its buffer back to its pool

    def _evict_device(self) -> None:
        while self.device_used > self.device_bytes and self._device:
            self._evict_one()

    def _evict_one(self) -> None:
        user = choose_victim(self._device.items(), self.clock(), self.evict_cost_s, self.evict_candidates)
        assert user is not None  # callers evict only from a non-empty tier
        e = self._device.pop(user)
        self.device_used -= e.nbytes
        self.stats.evictions_to_dram += 1
        self._to_dram(user, e)
        e.kv.release()  # an arena range is freed once the copy out is made (and nobody computes on it)

    def _to_dram(self, user: str, e: _Entry) -> None:
        if e.nbytes > self._dram.capacity_bytes or self._dram.ttl_s <= 0:  # refused before any copy is made
            self.stats.dram_dropped += 1
            return
        self.expire()
        host = self.to_host(e.kv)
        if isinstance(host, ArenaKV):  # never keep views of a range that is about to be reused
            host = host.to(host.arena.device)
        self.stats.dram_dropped += self._dram.put(user, e.version, host, e.nbytes)

    def expire(self) -> int:
        """Drops DRAM entries past their TTL (oldest first: insertion order is expiry order)."""
        n = self._dram.expire()
        self.stats.dram_expired += n
        return n

    # -- lookup -------------------------------------------------------------------------------------
    async def lookup(self, user: str, version: str, *, count: bool = True) -> tuple[PrefixKV | None, Tier | None]:
        """The user's prefix K/V on the device (promoting it from DRAM if needed), and where it was.

        ``count=False`` leaves the hit/miss counters alone: a pre-infer signal that finds its prefix
        cached is not a cache hit (the hit rate is over rank lookups only)."""
        e = self._device.get(user)
        if e is not None and e.version == version:
            self._device.move_to_end(user)
            e.used = self.clock()
            self.stats.device_hits += count
            return e.kv, "device"
        key = (user, version)
        pending = self._promoting.get(key)
        if pending is not None:
            kv = await asyncio.shield(pending)
            if kv is not None:
                self.stats.dram_hits += count
                return kv, "dram"
            self.stats.misses += count
            return None, None
        self.expire()
        d = self._dram.take(user, version)
        if d is None:
            self.stats.misses += count
            return None, None
        fut: asyncio.Future[PrefixKV | None] = asyncio.get_running_loop().create_future()
        self._promoting[key] = fut
        try:
            kv = await self.to_device(d.kv) if self.to_device is not None else d.kv
        except BaseException as exc:
            d.kv.release()
            fut.set_result(None)
            del self._promoting[key]
            if isinstance(exc, Exception):
                self.stats.misses += count
                return None, None
            raise
        self.stats.promotions += 1
        self.stats.dram_hits += count
        newer = self._device.get(user) is not None or self._dram.get(user) is not None  # stored while we copied
        if not newer and self.put(user, version, kv):
            kv = self._device[user].kv  # with an arena: the copy in its fresh range
        if kv is not d.kv:  # the host copy is read by nobody now (a promotion's copy is queued before this)
            d.kv.release()
        fut.set_result(kv)
        del self._promoting[key]
        return kv, "dram"

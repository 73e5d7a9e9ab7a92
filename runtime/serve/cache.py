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
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from grstack.runtime.serve.clock import Now, SystemClock
from grstack.runtime.serve.engine import PrefixKV
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
    expires: float = 0.0  # DRAM tier only


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

    def __post_init__(self) -> None:
        self._device: OrderedDict[str, _Entry] = OrderedDict()
        self._dram: OrderedDict[str, _Entry] = OrderedDict()
        self._promoting: dict[tuple[str, str], asyncio.Future[PrefixKV | None]] = {}
        self.device_used = 0
        self.dram_used = 0

    # -- inspection ---------------------------------------------------------------------------------
    def tier_of(self, user: str, version: str) -> Tier | None:
        e = self._device.get(user)
        if e is not None and e.version == version:
            return "device"
        e = self._dram.get(user)
        if e is not None and e.version == version and e.expires > self.clock():
            return "dram"
        return None

    def extendable(self, user: str, items: np.ndarray, timestamps: np.ndarray, actions: np.ndarray | None = None,
                   context: bytes | None = None) -> str | None:
        """The version of ``user``'s cached prefix (either tier) when it is a strict prefix of the events
        ``items``/``timestamps`` (with their ``actions`` and the user's ``context`` key when the model reads
        them; decided exactly: the hash of the new history's first ``P`` events equals the cached version, ``P``
        the cached prefix's events), else None. Such an entry can be extended by the new events instead of
        prefilling from scratch."""
        now = self.clock()
        for tier in (self._device, self._dram):
            e = tier.get(user)
            if e is None or (tier is self._dram and e.expires <= now):
                continue
            p = e.kv.length - self.head
            if 0 < p < len(items) and prefix_hash(items[:p], timestamps[:p],
                                                  actions[:p] if actions is not None else None,
                                                  context) == e.version:
                return e.version
        return None

    def entries(self, tier: Tier) -> int:
        return len(self._device if tier == "device" else self._dram)

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
        self._device[user] = _Entry(version, kv, nbytes)
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
        e = self._dram.pop(user, None)
        if e is not None:
            self.dram_used -= e.nbytes

    def _evict_device(self) -> None:
        while self.device_used > self.device_bytes and self._device:
            self._evict_one()

    def _evict_one(self) -> None:
        user, e = self._device.popitem(last=False)
        self.device_used -= e.nbytes
        self.stats.evictions_to_dram += 1
        self._to_dram(user, e)
        e.kv.release()  # an arena range is freed once the copy out is made (and nobody computes on it)

    def _to_dram(self, user: str, e: _Entry) -> None:
        if e.nbytes > self.dram_bytes or self.dram_ttl_s <= 0:
            self.stats.dram_dropped += 1
            return
        self.expire()
        host = self.to_host(e.kv)
        if isinstance(host, ArenaKV):  # never keep views of a range that is about to be reused
            host = host.to(host.arena.device)
        self._dram[user] = _Entry(e.version, host, e.nbytes, self.clock() + self.dram_ttl_s)
        self.dram_used += e.nbytes
        while self.dram_used > self.dram_bytes:
            _, old = self._dram.popitem(last=False)
            self.dram_used -= old.nbytes
            self.stats.dram_dropped += 1

    def expire(self) -> int:
        """Drops DRAM entries past their TTL (oldest first: insertion order is expiry order)."""
        now, n = self.clock(), 0
        while self._dram:
            user, e = next(iter(self._dram.items()))
            if e.expires > now:
                break
            del self._dram[user]
            self.dram_used -= e.nbytes
            n += 1
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
        e = self._dram.get(user)
        if e is None or e.version != version:
            self.stats.misses += count
            return None, None
        fut: asyncio.Future[PrefixKV | None] = asyncio.get_running_loop().create_future()
        self._promoting[key] = fut
        del self._dram[user]
        self.dram_used -= e.nbytes
        try:
            kv = await self.to_device(e.kv) if self.to_device is not None else e.kv
        except BaseException as exc:
            fut.set_result(None)
            del self._promoting[key]
            if isinstance(exc, Exception):
                self.stats.misses += count
                return None, None
            raise
        self.stats.promotions += 1
        self.stats.dram_hits += count
        current = self._device.get(user) or self._dram.get(user)
        if current is None and self.put(user, version, kv):  # nobody stored a newer version while we copied
            kv = self._device[user].kv  # with an arena: the copy in its fresh range
        fut.set_result(kv)
        del self._promoting[key]
        return kv, "dram"

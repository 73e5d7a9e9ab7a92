"""Which device-tier entry to evict: least recently used, or the one cheapest to get back per byte.

An evicted prefix costs its next rank a promotion from DRAM or, once DRAM has dropped it, a recompute; both
grow with its length, a recompute faster than linearly (attention over the prefix) and a short prefix's
fixed overhead weighs more per byte. Evicting by recency alone treats a byte of every prefix alike. The
cost-aware policy keeps the entries whose bytes are dearest to rebuild and most recently used: among the
``candidates`` least recently used entries it evicts the lowest ``cost_s(tokens) / bytes / age``, ``age`` the
seconds since the entry was last put or hit. With a cost proportional to bytes (or none) that is the oldest
entry: plain LRU is the degenerate case. Only the oldest ``candidates`` are scanned, so an eviction costs
O(candidates) whatever the cache's size, and a hot entry is never the victim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["EvictionEntry", "choose_victim", "recompute_seconds"]

MIN_AGE_S = 1e-6  # entries touched at the same instant compare by cost per byte alone


class EvictionEntry(Protocol):
    @property
    def nbytes(self) -> int: ...

    @property
    def used(self) -> float: ...

    @property
    def tokens(self) -> int: ...


def choose_victim(entries: Iterable[tuple[str, EvictionEntry]], now: float,
                  cost_s: Callable[[int], float] | None, candidates: int = 64) -> str | None:
    """The key to evict from ``entries`` (least recently used first); None when there are none."""
    best: tuple[float, str] | None = None
    for key, e in itertools.islice(entries, max(1, candidates) if cost_s is not None else 1):
        if cost_s is None:
            return key
        value = cost_s(e.tokens) / max(e.nbytes, 1) / max(now - e.used, MIN_AGE_S)
        if best is None or value < best[0]:  # ties: the older entry
            best = (value, key)
    return best[1] if best is not None else None


def recompute_seconds(profile: Callable[[], Any]) -> Callable[[int], float]:
    """Seconds to recompute a prefix of n tokens from a ranker's start-up profile (``profile()``: its
    :class:`grstack.runtime.serve.schemas.Profile` or None); proportional to n until it is measured."""
    from grstack.runtime.serve.trigger import latest_model

    model = latest_model(profile)

    def cost(n: int) -> float:
        m = model()
        return float(n) if m is None else m.predict_prefill_ms(n) / 1e3

    return cost

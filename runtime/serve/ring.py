"""Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018): the default placement.

Each replica owns ``vnodes`` points on a 64-bit ring; a user's preference order is the replicas met walking
clockwise from the user's hash. With bounded load, a replica is skipped while it already carries
``ceil(c * (total + 1) / n)`` in-flight requests, so one hot user cannot pile work onto one replica, and
adding or removing a replica moves only the users whose arc changed. Hashes are blake2b, stable across
processes and restarts (unlike Python's ``hash``), so every router computes the same order.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Mapping


def stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self.nodes: tuple[str, ...] = ()
        self.set_nodes(nodes)

    def set_nodes(self, nodes: Iterable[str]) -> None:
        nodes = tuple(sorted(set(nodes)))
        if nodes == self.nodes:
            return
        pts = sorted((stable_hash(f"{n}#{i}"), n) for n in nodes for i in range(self.vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [n for _, n in pts]
        self.nodes = nodes

    def order(self, key: str) -> list[str]:
        """Distinct replicas in ring order starting at ``key``'s hash."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, stable_hash(key)) % len(self._points)
        seen: list[str] = []
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.nodes):
                    break
        return seen

    def choose(self, key: str, load: Mapping[str, int] | None = None, c: float = 1.25,
               exclude: Iterable[str] = ()) -> str | None:
        """The first replica in ``key``'s order whose load is under the bound (ignoring ``exclude``)."""
        skip = set(exclude)
        order = [n for n in self.order(key) if n not in skip]
        if not order:
            return None
        if load is None:
            return order[0]
        total = sum(load.get(n, 0) for n in order)
        cap = math.ceil(c * (total + 1) / len(order))
        for n in order:
            if load.get(n, 0) < cap:
                return n
        return order[0]

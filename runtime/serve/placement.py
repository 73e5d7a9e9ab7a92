"""Placement store: which ranker replicas exist, and which replica holds which user's prefix cache.

Two implementations behind one interface: :class:`MemoryPlacementStore` (embedded mode, one process) and
``EtcdPlacementStore`` (:mod:`grstack.runtime.serve.etcd_store`). Semantics shared by both:

- replicas register under a lease with a TTL and keep it alive; a replica that stops refreshing vanishes,
  and so do the placements that point at it (they are attached to the replica's lease) unless they were
  written with their own TTL: those outlive it until the TTL (routers drop them from their view and ignore
  a placement on a replica that is not registered);
- placements are written with compare-and-swap on the key's revision (``expected=None`` means "only if
  absent"), so two routers placing the same user concurrently agree on one replica;
- a placement written with ``ttl_s`` expires that long after its last write (re-writing it refreshes it), so
  the store holds the users seen recently, not every user ever seen; without ``ttl_s`` it lives as long as
  its replica's lease;
- ``watch`` yields the full state first, then changes, so a router keeps a local view and routes from it
  without a store round trip on the request path.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from grstack.runtime.serve.clock import Now, SystemClock, sleeper


@dataclass(frozen=True)
class Replica:
    id: str
    url: str
    lease: int = 0


@dataclass(frozen=True)
class Placement:
    user: str
    replica: str
    version: str  # the prefix hash that was placed
    revision: int  # the store revision of this key: the CAS token


@dataclass(frozen=True)
class Event:
    kind: Literal["snapshot", "replica", "replica-gone", "placement", "placement-gone"]
    replica: Replica | None = None
    placement: Placement | None = None
    key: str = ""  # replica id / user for the "-gone" kinds
    replicas: tuple[Replica, ...] = ()
    placements: tuple[Placement, ...] = ()


class StoreUnavailable(Exception):
    """The store could not be reached (callers fall back to their local view and the hash ring)."""


class PlacementStore(abc.ABC):
    @abc.abstractmethod
    async def register(self, replica: Replica, ttl_s: float) -> None:
        """Registers (or re-registers) ``replica`` and keeps its lease alive until ``unregister``."""

    @abc.abstractmethod
    async def unregister(self, replica_id: str) -> None: ...

    @abc.abstractmethod
    async def replicas(self) -> dict[str, Replica]: ...

    @abc.abstractmethod
    async def get_placement(self, user: str) -> Placement | None: ...

    @abc.abstractmethod
    async def cas_placement(self, user: str, replica_id: str, version: str, expected: Placement | None,
                            ttl_s: float | None = None) -> Placement | None:
        """Writes user -> replica if the current placement is ``expected`` (None: absent), expiring ``ttl_s``
        after this write (None: with the replica's lease).

        Returns the new placement, or None if the compare failed or the replica is not registered.
        """

    @abc.abstractmethod
    async def delete_placement(self, user: str, expected: Placement) -> bool:
        """Deletes the placement if it is still ``expected`` (same revision); False if it changed or is gone."""

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[Event]:
        """A snapshot event, then one event per change; raises StoreUnavailable when the store is lost."""

    @abc.abstractmethod
    def stop_keepalive(self, replica_id: str) -> None:
        """Stops refreshing a replica's lease, as a crash would: it expires after its TTL."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryPlacementStore(PlacementStore):
    """Embedded mode: the same semantics in one process (leases expire on ``clock``, the system's by default)."""

    def __init__(self, clock: Now | None = None, sweep_s: float = 0.2) -> None:
        self._clock: Now = clock if clock is not None else SystemClock()
        self._sleep = sleeper(self._clock)
        self._sweep_s = sweep_s
        self._replicas: dict[str, tuple[Replica, float, float]] = {}  # id -> (replica, ttl, expires)
        self._placements: dict[str, Placement] = {}
        self._placement_expires: dict[str, float] = {}  # user -> when a placement written with a TTL expires
        self._revision = 0
        self._next_lease = 1
        self._watchers: list[asyncio.Queue[Event]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._keepalive: dict[str, asyncio.Task[None]] = {}

    def _emit(self, ev: Event) -> None:
        for q in self._watchers:
            q.put_nowait(ev)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while True:
            await self._sleep(self._sweep_s)
            self.expire()

    def expire(self) -> None:
        now = self._clock()
        for rid in [r for r, (_, ttl, exp) in self._replicas.items() if ttl > 0 and exp <= now]:
            self._remove_replica(rid)
        for user in [u for u, exp in self._placement_expires.items() if exp <= now]:
            self._drop_placement(user)

    def _drop_placement(self, user: str) -> None:
        self._placement_expires.pop(user, None)
        if self._placements.pop(user, None) is not None:
            self._revision += 1
            self._emit(Event("placement-gone", key=user))

    def _remove_replica(self, rid: str) -> None:
        if self._replicas.pop(rid, None) is None:
            return
        self._revision += 1
        self._emit(Event("replica-gone", key=rid))
        for user in [u for u, p in self._placements.items() if p.replica == rid and u not in self._placement_expires]:
            self._drop_placement(user)

    async def register(self, replica: Replica, ttl_s: float) -> None:
        """``ttl_s <= 0`` registers without a lease (static replicas of the embedded mode)."""
        self._ensure_sweeper()
        self._revision += 1
        lease = self._next_lease
        self._next_lease += 1
        replica = Replica(replica.id, replica.url, lease)
        self._replicas[replica.id] = (replica, ttl_s, self._clock() + ttl_s)
        self._emit(Event("replica", replica=replica))
        if ttl_s > 0:
            old = self._keepalive.pop(replica.id, None)
            if old is not None:
                old.cancel()
            self._keepalive[replica.id] = asyncio.get_running_loop().create_task(
                self._keep(replica.id, ttl_s))

    async def _keep(self, rid: str, ttl_s: float) -> None:
        while rid in self._replicas:
            await self._sleep(ttl_s / 3)
            if rid in self._replicas:
                r, ttl, _ = self._replicas[rid]
                self._replicas[rid] = (r, ttl, self._clock() + ttl)

    def stop_keepalive(self, replica_id: str) -> None:
        """Simulates a crashed replica: its lease is no longer refreshed and expires after its TTL."""
        task = self._keepalive.pop(replica_id, None)
        if task is not None:
            task.cancel()

    async def unregister(self, replica_id: str) -> None:
        self.stop_keepalive(replica_id)
        self._remove_replica(replica_id)

    async def replicas(self) -> dict[str, Replica]:
        self.expire()
        return {rid: r for rid, (r, _, _) in self._replicas.items()}

    async def get_placement(self, user: str) -> Placement | None:
        return self._placements.get(user)

    def _is(self, user: str, expected: Placement | None) -> bool:
        current = self._placements.get(user)
        if expected is None:
            return current is None
        return current is not None and current.revision == expected.revision

    async def cas_placement(self, user: str, replica_id: str, version: str, expected: Placement | None,
                            ttl_s: float | None = None) -> Placement | None:
        self.expire()
        if not self._is(user, expected) or replica_id not in self._replicas:
            return None
        self._revision += 1
        p = Placement(user, replica_id, version, self._revision)
        self._placements[user] = p
        if ttl_s is not None:
            self._placement_expires[user] = self._clock() + ttl_s
        else:
            self._placement_expires.pop(user, None)
        self._emit(Event("placement", placement=p))
        return p

    async def delete_placement(self, user: str, expected: Placement) -> bool:
        self.expire()
        if not self._is(user, expected):
            return False
        self._drop_placement(user)
        return True

    async def watch(self) -> AsyncIterator[Event]:
        self._ensure_sweeper()
        self.expire()
        q: asyncio.Queue[Event] = asyncio.Queue()
        self._watchers.append(q)
        try:
            yield Event("snapshot", replicas=tuple(r for r, _, _ in self._replicas.values()),
                        placements=tuple(self._placements.values()))
            while True:
                yield await q.get()
        finally:
            self._watchers.remove(q)

    async def close(self) -> None:
        for task in [self._sweeper, *self._keepalive.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = None
        self._keepalive.clear()

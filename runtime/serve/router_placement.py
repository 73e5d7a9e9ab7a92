"""The router's view of placements (user -> replica holding its prefix) and their write-back to the store.

The store holds only exceptions: a placement on the user's ring home (the first replica in its hash-ring order
over the registered replicas, the same on every router) is derived, not written, and kept in the view as HOME;
stored placements expire ``placement_ttl_s`` after their last write (each prefill re-writes). Placements made
while the store is unreachable stay LOCAL and are written back (compare-and-swap) when it returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from grstack.runtime.serve.clock import Now
from grstack.runtime.serve.placement import Event, Placement, PlacementStore, Replica, StoreUnavailable
from grstack.runtime.serve.ring import HashRing
from grstack.runtime.serve.router_config import RouterConfig

log = logging.getLogger("grstack.runtime.serve.router")  # the router's log, whichever part speaks
LOCAL = -1  # revision of a placement known only to this router (written while the store was down)
HOME = 0  # revision of a placement on the user's ring home: derived, never stored (exceptions-only)


class PlacementBook:
    """``is_up(replica)``: whether a replica may serve now (a placement another router won keeps only then)."""

    def __init__(self, config: RouterConfig, store: PlacementStore, clock: Now,
                 is_up: Callable[[str], bool]) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self._is_up = is_up
        self.placements: dict[str, Placement] = {}
        self.store_up = False
        self._home_ring = HashRing()  # over the registered replicas: where an unstored placement is
        self._unsynced: dict[str, Placement | None] = {}  # LOCAL placement -> the stored one it replaces
        self._home_seen: dict[str, float] = {}  # HOME placements by last confirmation (oldest first)
        self.tasks: set[asyncio.Task[Any]] = set()  # write-backs in flight

    # -- store events -------------------------------------------------------------------------------
    def apply(self, ev: Event, replicas: Mapping[str, Replica]) -> None:
        """The placement part of a store event (``replicas``: the registered ones after it); the store's word
        wins over a settled local entry."""
        if ev.kind == "snapshot":
            stored = {p.user: p for p in ev.placements if p.replica in replicas}
            # LOCAL entries wait for the write-back (which decides against the store); HOME ones are not stored
            kept = {u: p for u, p in self.placements.items() if p.replica in replicas and (
                p.revision == LOCAL or (p.revision == HOME and u not in stored))}
            self.placements = {**stored, **kept}
        elif ev.kind == "replica-gone":
            self.placements = {u: p for u, p in self.placements.items() if p.replica != ev.key}
        elif ev.kind == "placement" and ev.placement is not None:
            self.settle(ev.placement)
        elif ev.kind == "placement-gone":  # deleted or expired; a HOME or LOCAL entry was never the stored one
            current = self.placements.get(ev.key)
            if current is not None and current.revision > 0:
                del self.placements[ev.key]

    def members_changed(self, replicas: Mapping[str, Replica]) -> None:
        """Replicas joined or left (or a snapshot came): ring homes move, and what they moved is written."""
        self._home_ring.set_nodes(replicas)
        self._pin_moved_homes()
        self._unsynced = {u: e for u, e in self._unsynced.items()
                          if u in self.placements and self.placements[u].revision == LOCAL}
        if self._unsynced or any(p.revision == LOCAL for p in self.placements.values()):
            self.schedule_write_back()

    # -- homes --------------------------------------------------------------------------------------
    def home(self, user: str) -> str | None:
        """The user's ring home: the first registered replica in its ring order (the same on every router
        that sees the same replicas, whatever their health), where a placement needs no store entry."""
        order = self._home_ring.order(user)
        return order[0] if order else None

    def _pin_moved_homes(self) -> None:
        """A replica joined or left and moved some users' ring home away from where their prefix is: those
        placements become exceptions, to be written (otherwise every router would route them to the new home,
        a cache miss)."""
        if not self.config.placement_exceptions_only:
            return
        for user, p in list(self.placements.items()):
            if p.revision == HOME and self.home(user) != p.replica:
                self.placements[user] = dataclasses.replace(p, revision=LOCAL)
                self._unsynced[user] = None
                self._home_seen.pop(user, None)

    def settle(self, placement: Placement) -> None:
        self.placements[placement.user] = placement
        self._unsynced.pop(placement.user, None)
        self._home_seen.pop(placement.user, None)

    def _set_home(self, user: str, replica: str, version: str) -> None:
        self.settle(Placement(user, replica, version, HOME))
        self._home_seen[user] = self.clock()
        ttl = self.config.placement_ttl_s
        if ttl is None:
            return
        cutoff = self.clock() - ttl  # HOME entries expire from the view like stored ones from the store
        old = []
        for u, seen in self._home_seen.items():
            if seen > cutoff:
                break
            old.append(u)
        for u in old:
            del self._home_seen[u]
            if (p := self.placements.get(u)) is not None and p.revision == HOME:
                del self.placements[u]

    def _keep_local(self, user: str, replica: str, version: str, expected: Placement | None) -> None:
        self.placements[user] = Placement(user, replica, version, LOCAL)
        self._unsynced[user] = expected
        self._home_seen.pop(user, None)

    # -- writes -------------------------------------------------------------------------------------
    async def place(self, user: str, version: str, replica: str, seen: Placement | None) -> str:
        """Records user -> replica in the store (CAS; only an exception to the ring home is written, with the
        TTL, so a new prefill refreshes it); returns the replica that won. With the store unreachable the
        placement stays LOCAL and is written back when the store returns."""
        if seen is not None and seen.revision == LOCAL:
            expected = self._unsynced.get(user)
        else:
            expected = seen if seen is not None and seen.revision > 0 else None
        if not self.store_up:
            self._keep_local(user, replica, version, expected)
            return replica
        try:
            return await self._store_placement(user, version, replica, expected)
        except StoreUnavailable:
            self._keep_local(user, replica, version, expected)
            return replica

    def schedule_write_back(self) -> None:
        if not self.store_up or any(not t.done() for t in self.tasks):
            return  # a running write-back picks up what was added
        try:
            task = asyncio.get_running_loop().create_task(self._write_back())
        except RuntimeError:  # no loop: the view is being set up by hand
            return
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _write_back(self) -> None:
        """Writes the LOCAL placements (made while the store was unreachable, or pinned after a ring change) to
        the store with compare-and-swap against what they replaced; a placement another router wrote meanwhile
        wins and the view adopts it. Stops when the store is lost again (the next snapshot restarts it)."""
        tried: set[Placement] = set()
        while self.store_up:
            todo = [p for p in self.placements.values() if p.revision == LOCAL and p not in tried]
            if not todo:
                return
            for p in todo:
                tried.add(p)
                if self.placements.get(p.user) != p:
                    continue  # changed meanwhile (a watch event or a new prefill)
                try:
                    await self._store_placement(p.user, p.version, p.replica, self._unsynced.get(p.user))
                except StoreUnavailable as exc:
                    log.info("placement write-back paused, store unavailable: %s", exc)
                    return

    async def _store_placement(self, user: str, version: str, replica: str, expected: Placement | None) -> str:
        """Makes the store say user -> replica given that it held ``expected``; returns the replica that won."""
        cfg = self.config
        at_home = cfg.placement_exceptions_only and replica == self.home(user)
        if at_home and expected is None:
            self._set_home(user, replica, version)
            return replica
        if at_home:
            assert expected is not None
            if await self.store.delete_placement(user, expected):
                self._set_home(user, replica, version)
                return replica
        elif cfg.placement_ttl_s is None and expected is not None and expected.replica == replica:
            self.settle(expected)  # stored already and it does not expire: nothing to refresh
            return replica
        else:
            placed = await self.store.cas_placement(user, replica, version, expected, cfg.placement_ttl_s)
            if placed is not None:
                self.settle(placed)
                return replica
        # The compare failed: another router changed the placement. Its placement wins while its replica is up.
        winner = await self.store.get_placement(user)
        if winner is not None and self._is_up(winner.replica):
            self.settle(winner)
            return winner.replica
        if at_home:
            if winner is None or await self.store.delete_placement(user, winner):
                self._set_home(user, replica, version)
                return replica
        elif (placed := await self.store.cas_placement(user, replica, version, winner, cfg.placement_ttl_s)):
            self.settle(placed)
            return replica
        self._unsynced.pop(user, None)  # lost twice: the watch brings the winner
        self.placements.pop(user, None)
        return replica

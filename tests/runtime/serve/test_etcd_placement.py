"""Issue #12 item 7: placements that scale — a TTL on stored placements, only exceptions to the ring home
stored, and the placements made during an etcd outage written back when it returns (a real etcd server)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from grstack.runtime.cli_args import ArgParser
from grstack.runtime.errors import UserError
from grstack.runtime.serve.placement import Event, MemoryPlacementStore, PlacementStore, Replica
from grstack.runtime.serve.ring import HashRing
from grstack.runtime.serve.router import HOME, LOCAL, Router, RouterConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = "/grstack/ranking/scale"
REPLICAS = ("r1", "r2", "r3")


async def wait_for(pred, timeout_s: float = 15.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"{what} not reached within {timeout_s} s"
        await asyncio.sleep(0.05)


def user_homed(on: str, nodes: tuple[str, ...], avoid: frozenset[str] = frozenset(),
               then: tuple[tuple[str, ...], str] | None = None) -> str:
    """A user whose ring home over ``nodes`` is ``on`` (and, with ``then=(nodes2, home2)``, home2 over nodes2)."""
    for i in range(10_000):
        u = f"user-{i}"
        if u in avoid or HashRing(nodes).order(u)[0] != on:
            continue
        if then is None or HashRing(then[0]).order(u)[0] == then[1]:
            return u
    raise AssertionError("no such user")


def where(router: Router, user: str) -> str | None:
    """Where a router sends ``user``: its placement, else its ring home."""
    p = router.placements.get(user)
    return p.replica if p is not None else router.home(user)


class View:
    """A router's store view, driven by its watch loop alone (no rankers, no health probes)."""

    def __init__(self, store: PlacementStore, **config: object) -> None:
        self.router = Router(RouterConfig(startup_timeout_s=0.1, **config), store)  # type: ignore[arg-type]
        self.task: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        self.task = asyncio.create_task(self.router._watch_loop())
        await wait_for(lambda: self.router.store_up and set(self.router.replicas) >= {"r1", "r2"}, what="synced")

    async def disconnect(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait([self.task], timeout=5)

    async def close(self) -> None:
        await self.disconnect()
        await self.router.stop()


@contextlib.asynccontextmanager
async def etcd_views(url: str, n: int, replicas: tuple[str, ...] = REPLICAS, timeout_s: float = 1.0,
                     **config: object) -> AsyncIterator[tuple[PlacementStore, list[View]]]:
    from grstack.runtime.serve.etcd_store import EtcdPlacementStore

    registrar = EtcdPlacementStore(url, ROOT, timeout_s=timeout_s)
    for rid in replicas:
        await registrar.register(Replica(rid, f"http://127.0.0.1:1/{rid}"), ttl_s=30)
    views = [View(EtcdPlacementStore(url, ROOT, timeout_s=timeout_s), **config) for _ in range(n)]
    try:
        for v in views:
            await v.connect()
        yield registrar, views
    finally:
        for v in views:
            await v.close()
        await registrar.close()


async def test_memory_store_placements_expire_and_outlive_their_replica_only_with_a_ttl() -> None:
    now = [0.0]
    store = MemoryPlacementStore(clock=lambda: now[0])
    events: list[Event] = []

    async def consume() -> None:
        async for ev in store.watch():
            events.append(ev)

    task = asyncio.create_task(consume())
    await wait_for(lambda: events)  # the snapshot: the watch is live
    try:
        await store.register(Replica("r1", "http://a"), ttl_s=0)
        await store.register(Replica("r2", "http://b"), ttl_s=0)
        first = await store.cas_placement("u", "r1", "h", None, ttl_s=10)
        await store.cas_placement("lease-bound", "r2", "h", None)
        await store.cas_placement("ttl-bound", "r2", "h", None, ttl_s=10)
        now[0] = 6.0
        refreshed = await store.cas_placement("u", "r1", "h2", first, ttl_s=10)  # a new prefill re-writes it
        assert refreshed is not None and refreshed.revision > first.revision
        assert not await store.delete_placement("u", first)  # a stale revision deletes nothing
        await store.unregister("r2")
        assert await store.get_placement("lease-bound") is None
        assert await store.get_placement("ttl-bound") is not None  # outlives its replica until its TTL
        now[0] = 11.0
        store.expire()
        assert await store.get_placement("ttl-bound") is None and await store.get_placement("u") is not None
        now[0] = 16.5
        store.expire()
        assert await store.get_placement("u") is None
        await wait_for(lambda: sum(e.kind == "placement-gone" for e in events) == 3)
        assert [e.key for e in events if e.kind == "placement-gone"] == ["lease-bound", "ttl-bound", "u"]
    finally:
        task.cancel()
        await store.close()


async def test_stored_placements_expire_in_etcd_and_leave_every_view(etcd) -> None:
    async with etcd_views(etcd.url, 2, placement_ttl_s=2.0) as (registrar, (a, b)):
        user = user_homed("r1", REPLICAS)
        first = await a.router._place(user, "v1", "r2", None)  # not its ring home: an exception, stored
        assert first == "r2"
        stored = await registrar.get_placement(user)
        assert stored is not None and stored.replica == "r2"
        await wait_for(lambda: where(b.router, user) == "r2", what="the other router sees the placement")
        lease_before = (await registrar._client.get(registrar._pkey(user))).lease
        await asyncio.sleep(1.1)  # past the lease slice (a tenth of the TTL, at least 1 s): a new shared lease
        await a.router._place(user, "v2", "r2", a.router.placements[user])  # re-confirmed by a new prefill
        kv = await registrar._client.get(registrar._pkey(user))
        assert kv.lease != lease_before and (await registrar.get_placement(user)).version == "v2"
        await wait_for(lambda: user not in a.router.placements and user not in b.router.placements,
                       what="the expiry reaches both views")
        assert await registrar.get_placement(user) is None
        assert where(a.router, user) == where(b.router, user) == "r1"  # back to the ring home on both


async def test_only_exceptions_are_stored_and_routers_agree(etcd) -> None:
    async with etcd_views(etcd.url, 2, replicas=("r1", "r2"), placement_ttl_s=60.0) as (registrar, (a, b)):
        user = user_homed("r1", ("r1", "r2"), then=(REPLICAS, "r3"))
        assert await a.router._place(user, "v1", "r1", None) == "r1"  # its ring home: nothing written
        assert a.router.placements[user].revision == HOME and await registrar.get_placement(user) is None
        assert where(b.router, user) == "r1"

        await a.router._place(user, "v2", "r2", a.router.placements[user])  # moved off its home: stored
        await wait_for(lambda: where(b.router, user) == "r2", what="exception seen by the other router")
        assert b.router.placements[user].revision > 0

        # Back home: the stored exception is deleted (compare-and-delete) and both views fall back to the ring.
        await a.router._place(user, "v3", "r1", a.router.placements[user])
        assert await registrar.get_placement(user) is None
        await wait_for(lambda: user not in b.router.placements, what="deletion seen by the other router")
        assert where(a.router, user) == where(b.router, user) == "r1"

        # A new replica moves the user's ring home to it; its prefix is on r1, so the placement is pinned.
        await registrar.register(Replica("r3", "http://127.0.0.1:1/r3"), ttl_s=30)
        await wait_for(lambda: "r3" in b.router.replicas and b.router.placements.get(user) is not None,
                       what="the pinned placement reaches the other router")
        assert b.router.home(user) == "r3" and where(b.router, user) == where(a.router, user) == "r1"
        stored = await registrar.get_placement(user)
        assert stored is not None and stored.replica == "r1"


async def test_outage_placements_are_written_back_and_a_concurrent_write_wins(etcd) -> None:
    async with etcd_views(etcd.url, 2, timeout_s=0.5, placement_ttl_s=60.0) as (registrar, (a, b)):
        old = user_homed("r1", REPLICAS)
        new = user_homed("r1", REPLICAS, avoid=frozenset({old}))
        race = user_homed("r1", REPLICAS, avoid=frozenset({old, new}))
        await a.router._place(old, "v1", "r2", None)  # stored before the outage
        await wait_for(lambda: where(b.router, old) == "r2")

        etcd.kill()
        await wait_for(lambda: not a.router.store_up and not b.router.store_up, what="both notice the outage")
        # During the outage A places on its local view only: a new user, the old one back home, a contested one.
        assert await a.router._place(new, "v1", "r2", None) == "r2"
        assert await a.router._place(old, "v2", "r1", a.router.placements[old]) == "r1"
        assert await a.router._place(race, "v1", "r2", None) == "r2"
        assert {a.router.placements[u].revision for u in (new, old, race)} == {LOCAL}
        await a.disconnect()  # A stays away a little longer, so B's write lands first

        etcd.start()
        await wait_for(lambda: b.router.store_up, what="B reconnects")
        assert await b.router._place(race, "v9", "r3", b.router.placements.get(race)) == "r3"
        await a.connect()  # A's watch returns: snapshot, then the write-back
        await wait_for(lambda: all(p.revision != LOCAL for p in a.router.placements.values()),
                       what="A's local placements settled")

        assert (await registrar.get_placement(new)).replica == "r2"  # written back
        assert await registrar.get_placement(old) is None  # its exception deleted: it is home again
        assert a.router.placements[old].revision == HOME
        assert (await registrar.get_placement(race)).replica == "r3"  # B's write wins; A adopts it
        assert a.router.placements[race].replica == "r3"
        await wait_for(lambda: all(where(a.router, u) == where(b.router, u) for u in (new, old, race)),
                       what="both routers agree on every user")
        assert [where(b.router, u) for u in (new, old, race)] == ["r2", "r1", "r3"]


def test_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from grstack.runtime.serve import cli

    parser = ArgParser()
    cli.register(parser)
    cfg = cli.router_config(parser.parse_args(["router", "--etcd", "http://127.0.0.1:2379"]))
    assert (cfg.placement_ttl_s, cfg.placement_exceptions_only) == (3600.0, True)
    args = parser.parse_args(["router", "--etcd", "http://e:2379", "--placement-ttl-s", "0",
                              "--store-all-placements"])
    cfg = cli.router_config(args)
    assert (cfg.placement_ttl_s, cfg.placement_exceptions_only) == (None, False)
    with pytest.raises(UserError, match="--placement-ttl-s"):
        cli.router_config(parser.parse_args(["router", "--etcd", "http://e:2379", "--placement-ttl-s", "-1"]))

"""The placement-store contract, on the in-memory store and on a real etcd server."""

from __future__ import annotations

import asyncio
import time

import pytest

from grstack.runtime.serve.placement import Event, MemoryPlacementStore, PlacementStore, Replica

# Bounded: a hang (a store client that never answers) fails fast instead of stalling the suite.
pytestmark = pytest.mark.timeout(120)


# The in-memory store is a unit test; the same contract on a real etcd server is an integration test.
@pytest.fixture(params=[pytest.param("memory", marks=pytest.mark.unit),
                        pytest.param("etcd", marks=pytest.mark.integration)])
async def store(request: pytest.FixtureRequest):
    if request.param == "memory":
        s: PlacementStore = MemoryPlacementStore(sweep_s=0.05)
    else:
        from grstack.runtime.serve.etcd_store import EtcdPlacementStore

        etcd = request.getfixturevalue("etcd")
        s = EtcdPlacementStore(etcd.url, root="/test", timeout_s=2.0)
    yield s
    await s.close()


async def wait_for(pred, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_compare_and_swap(store: PlacementStore) -> None:
    await store.register(Replica("r1", "http://127.0.0.1:1"), ttl_s=5)
    await store.register(Replica("r2", "http://127.0.0.1:2"), ttl_s=5)
    assert set(await store.replicas()) == {"r1", "r2"}
    first = await store.cas_placement("u", "r1", "h1", expected=None)
    assert first is not None and first.replica == "r1"
    assert await store.cas_placement("u", "r2", "h1", expected=None) is None  # exists already
    moved = await store.cas_placement("u", "r2", "h2", expected=first)
    assert moved is not None and moved.replica == "r2" and moved.revision > first.revision
    assert await store.cas_placement("u", "r1", "h3", expected=first) is None  # stale revision
    assert await store.get_placement("u") == moved
    assert await store.cas_placement("v", "nobody", "h", expected=None) is None  # unknown replica


async def test_watch_snapshot_then_changes(store: PlacementStore) -> None:
    await store.register(Replica("r1", "http://127.0.0.1:1"), ttl_s=5)
    await store.cas_placement("u", "r1", "h", expected=None)
    events: list[Event] = []

    async def consume() -> None:
        async for ev in store.watch():
            events.append(ev)

    task = asyncio.create_task(consume())
    await wait_for(lambda: events)
    snap = events[0]
    assert snap.kind == "snapshot"
    assert [r.id for r in snap.replicas] == ["r1"] and [p.user for p in snap.placements] == ["u"]
    await store.register(Replica("r2", "http://127.0.0.1:2"), ttl_s=5)
    await store.cas_placement("w", "r2", "h", expected=None)
    await store.unregister("r2")  # its lease goes, and with it the placement on it
    await wait_for(lambda: any(e.kind == "placement-gone" for e in events))
    kinds = [(e.kind, e.key or (e.replica.id if e.replica else e.placement.user)) for e in events[1:]]
    assert kinds[:2] == [("replica", "r2"), ("placement", "w")]
    assert set(kinds[2:]) == {("replica-gone", "r2"), ("placement-gone", "w")}
    assert await store.get_placement("u") is not None and await store.get_placement("w") is None
    task.cancel()


async def test_a_crashed_replica_expires_with_its_placements(store: PlacementStore) -> None:
    await store.register(Replica("r1", "http://127.0.0.1:1"), ttl_s=2)
    await store.register(Replica("r2", "http://127.0.0.1:2"), ttl_s=30)
    await store.cas_placement("u", "r1", "h", expected=None)
    await asyncio.sleep(1.0)
    assert "r1" in await store.replicas()  # kept alive past part of its TTL
    store.stop_keepalive("r1")
    end = time.monotonic() + 15
    while "r1" in await store.replicas():
        assert time.monotonic() < end, "the lease of a replica that stopped refreshing did not expire"
        await asyncio.sleep(0.2)
    assert await store.get_placement("u") is None
    assert set(await store.replicas()) == {"r2"}


async def test_placements_with_a_ttl_expire_and_outlive_their_replica(store: PlacementStore) -> None:
    await store.register(Replica("r1", "http://127.0.0.1:1"), ttl_s=30)
    await store.register(Replica("r2", "http://127.0.0.1:2"), ttl_s=30)
    short = await store.cas_placement("u", "r1", "h", expected=None, ttl_s=2)
    long = await store.cas_placement("w", "r2", "h", expected=None, ttl_s=30)
    assert short is not None and long is not None
    assert not await store.delete_placement("w", short)  # compare-and-delete: a wrong revision deletes nothing
    await store.unregister("r2")
    assert await store.get_placement("w") == long  # it has its own TTL: it outlives its replica
    assert await store.delete_placement("w", long) and await store.get_placement("w") is None
    end = time.monotonic() + 15
    while await store.get_placement("u") is not None:
        assert time.monotonic() < end, "a placement written with a 2 s TTL did not expire"
        await asyncio.sleep(0.2)
    assert "r1" in await store.replicas()  # the placement expired, not its replica

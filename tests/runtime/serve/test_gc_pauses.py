"""GC pauses off the serving path: the startup heap is frozen out of collections, pauses are exported."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from grstack.runtime.serve.gc_pauses import _LIVE, GcPauseMetric, freeze_startup_heap, frozen_heap
from grstack.runtime.serve.local import spawn_ranker


def _collectable(obj: object) -> bool:
    """Whether a collection would walk ``obj`` (it is in one of the three generations, not the frozen one)."""
    return any(o is obj for g in (0, 1, 2) for o in gc.get_objects(g))


def _count(registry: CollectorRegistry, generation: str) -> float:
    return registry.get_sample_value("t_gc_pause_seconds_count", {"generation": generation}) or 0.0


@pytest.mark.unit
def test_pauses_are_observed_until_closed() -> None:
    r = CollectorRegistry()
    metric = GcPauseMetric(r, "t")
    try:
        gc.collect()
        gc.collect()
        assert _count(r, "2") == 2
        assert r.get_sample_value("t_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        metric.close()
    gc.collect()
    assert _count(r, "2") == 2


@pytest.mark.unit
def test_a_dropped_metric_leaves_nothing_behind() -> None:
    metric = GcPauseMetric(CollectorRegistry(), "t")
    assert metric in _LIVE
    del metric
    gc.collect()
    assert len([m for m in _LIVE if m.histogram._name == "t_gc_pause_seconds"]) == 0


@pytest.mark.unit
def test_frozen_heap_hides_existing_objects_from_collections_and_thaws_them() -> None:
    class Marker:
        pass

    before = Marker()
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert not _collectable(before)
        during = Marker()
        assert _collectable(during)
    assert gc.get_freeze_count() == 0
    assert _collectable(before)


@pytest.mark.unit
def test_cyclic_garbage_made_after_the_freeze_is_still_collected() -> None:
    class Node:
        peer: object = None

    with frozen_heap():
        node = Node()
        node.peer = node  # a cycle: only the collector can free it
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None


@pytest.mark.unit
def test_freeze_startup_heap_reports_what_it_froze() -> None:
    try:
        assert freeze_startup_heap() > 0 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_started_ranker_has_frozen_its_startup_heap_and_exports_pauses(tiny_checkpoint: Path) -> None:
    async def go() -> str:
        r = await spawn_ranker(tiny_checkpoint, ["--device", "cpu", "--threads", "1", "--max-suffix", "8"])
        try:
            async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
                return await resp.text()
        finally:
            await r.stop()

    text = asyncio.run(go())
    frozen = [line for line in text.splitlines() if line.startswith("grstack_ranker_gc_frozen_objects ")]
    assert frozen and float(frozen[0].split()[1]) > 10_000  # torch, aiohttp and the model are out of reach
    assert 'grstack_ranker_gc_pause_seconds_count{generation="2"}' in text

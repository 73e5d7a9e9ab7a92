"""Keeps Python's garbage collector off the serving path's tail, and measures what is left of it.

A full (generation-2) collection walks every tracked object in the process and stops it meanwhile. A ranker or
router holds a large, permanent heap once it has started (the model, torch's and aiohttp's modules, the
warm-up's objects), so a full collection during serving stopped a ranker for 110-125 ms and the benchmark's
router process for 128-140 ms (measured with ``gc.callbacks`` at 512 tokens and 40 QPS): every request in flight
there missed a 100 ms SLO at once. :func:`freeze_startup_heap` moves what exists when startup is done into the
permanent generation (``gc.freeze``, the practice of large Python services), so later collections walk only
what serving itself allocates. Objects it froze are still freed by reference counting; only reference cycles
among them are never collected, which is why it runs after startup, on the long-lived heap, and not per
request. :class:`GcPauseMetric` exports each collection's pause, so a tail that a pause explains is visible.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


def freeze_startup_heap() -> int:
    """Collects once, then freezes every surviving object out of later collections; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """Freezes the heap for the block and thaws it after: for a process (a load generator) that builds a
    large short-lived heap between measured runs, so each run's collections skip what existed at its start
    and the next run's garbage can still be collected."""
    try:
        yield freeze_startup_heap()
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def recorded_gc_pauses() -> Iterator[list[float]]:
    """The seconds of each collection in this process while the block runs (a benchmark's own stops: its
    load generator must not be the one that paused)."""
    pauses: list[float] = []
    started: list[float] = []

    def record(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


class GcPauseMetric:
    """``<prefix>_gc_pause_seconds{generation}``: how long each collection stopped the process, and
    ``<prefix>_gc_frozen_objects``: how many objects :func:`freeze_startup_heap` took out of collections.

    One process-wide ``gc.callbacks`` entry serves every live metric (held weakly), so a service that is
    dropped without being stopped leaves nothing behind in the collector."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.histogram = Histogram(f"{prefix}_gc_pause_seconds", "garbage-collector pauses by generation",
                                   ["generation"], buckets=PAUSE_BUCKETS, registry=registry)
        frozen = Gauge(f"{prefix}_gc_frozen_objects", "objects frozen out of garbage collection", registry=registry)
        frozen.set_function(gc.get_freeze_count)
        _LIVE.add(self)
        if _callback not in gc.callbacks:
            gc.callbacks.append(_callback)

    def close(self) -> None:
        """Stops observing."""
        _LIVE.discard(self)


_LIVE: weakref.WeakSet[GcPauseMetric] = weakref.WeakSet()
_started: list[float] = []


def _callback(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
    elif _started:
        pause = time.perf_counter() - _started.pop()
        for metric in list(_LIVE):
            metric.histogram.labels(str(info["generation"])).observe(pause)

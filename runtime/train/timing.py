"""What an engine step's timing figures count (docs/training.md §4, "What the step's timing figures count").

Communication events. A step's communication events are the pieces of work that move data between ranks or
that the main (compute) thread hands off for them: a lookup (key routing with its All2All, retrieval of the
rows from the shard), a send of one unit's rows (semi-async: of the next batch's), a send of one unit's
gradients, the replica sum of the sparse gradient and the all-reduce of the clipping norm (each the whole
task, from its start in the thread that runs it to its end: the issuing or prefetch thread, or inline at
world size 1), and the dense buckets and the stats all-reduce (each from its launch until its wait
returns).

* ``comm_ms`` (the denominator of ``exposed_comm_ratio``): the summed length of the step's events inside the
  step (from ``Engine.step``'s start to its return; an event that spans two steps counts in each the part
  inside it). Events running at the same time each count.
* ``exposed_comm_ms`` (the numerator): the summed length of the same events during which the main thread
  was blocked on communication: waiting for a lookup, rows, gradient sends, the semi-async retrieval, the
  replica sum, the clipping norm, the dense buckets or the stats, or running an event itself (its own collectives; at world size 1, the lookups and
  sends, which run inline). So 0 <= exposed <= total, and the ratio is 1.0 when nothing overlapped compute.

The main thread's blocked intervals also define a rank's busy time: see ``Engine.step``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
Interval = tuple[float, float]


def exposure(events: Iterable[Interval], blocked: Iterable[Interval], start: float, end: float
             ) -> tuple[float, float]:
    """(total, exposed) seconds of ``events`` inside [start, end]: total = the summed length of every event
    clipped to the window; exposed = the summed length of each event's overlap with the ``blocked``
    intervals (disjoint: one thread's waits) inside the window. Always 0 <= exposed <= total."""
    clipped = [(max(a, start), min(b, end)) for a, b in events]
    clipped = [(a, b) for a, b in clipped if b > a]
    waits = [(max(a, start), min(b, end)) for a, b in blocked]
    waits = [(a, b) for a, b in waits if b > a]
    total = sum((b - a for a, b in clipped), 0.0)
    exposed = sum((max(0.0, min(b, d) - max(a, c)) for a, b in clipped for c, d in waits), 0.0)
    return total, exposed


class CommClock:
    """Records the intervals of communication events (from any thread) and of the main thread's waits. The
    main thread is the one that last called ``start`` (the engine's step)."""

    def __init__(self) -> None:
        self._main = threading.get_ident()
        self._lock = threading.Lock()
        self._done: list[Interval] = []
        self._running: dict[int, float] = {}
        self._ids = 0
        self._blocked: list[Interval] = []

    def start(self) -> None:
        """The calling thread is the main thread (the one whose waits count)."""
        self._main = threading.get_ident()

    def task(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` as one communication event (in whichever thread calls this; on the main thread,
        inline, the main thread is blocked in it throughout)."""
        with self._lock:
            key = self._ids
            self._ids += 1
            self._running[key] = t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            t1 = time.perf_counter()
            with self._lock:
                self._done.append((self._running.pop(key), t1))
            if threading.get_ident() == self._main:
                self._blocked.append((t0, t1))

    def wait(self, fn: Callable[..., T], *args: Any, event: bool = False) -> T:
        """The main thread blocks in ``fn(*args)`` (waiting for an event, or, ``event``, running a collective
        itself: then the interval is also an event)."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            t1 = time.perf_counter()
            self._blocked.append((t0, t1))
            if event:
                with self._lock:
                    self._done.append((t0, t1))

    def event(self, t0: float, t1: float) -> None:
        with self._lock:
            self._done.append((t0, t1))

    def blocked_s(self) -> float:
        """Seconds the main thread has been blocked since the last ``measure``."""
        return sum(b - a for a, b in self._blocked)

    def measure(self, start: float, end: float) -> tuple[float, float]:
        """(comm, exposed) seconds of the step [start, end]; then forgets the step's waits and the events that
        ended (events still running count up to ``end`` now and the rest of their length in later steps)."""
        with self._lock:
            events = [*self._done, *((t0, end) for t0 in self._running.values())]
            self._done = [e for e in self._done if e[1] > end]
        out = exposure(events, self._blocked, start, end)
        self._blocked = []
        return out

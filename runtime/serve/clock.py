"""The serving code's one source of time: a clock injected into every component, never reached for.

Components read ``clock()`` (monotonic seconds) and wait with ``await clock.sleep(s)``, so the same control plane
runs on the system clock in service and on a :class:`ManualClock` in tests (and, later, in a simulator): TTLs,
budget windows, ejections and deadlines then move only when the test advances time. A component that only
reads time takes any :data:`Now` (a plain ``lambda: t`` will do).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

Now = Callable[[], float]  # monotonic seconds; what a component that only reads time needs
T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    def __call__(self) -> float:
        """Monotonic seconds (the origin is the clock's own)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Returns once ``seconds`` of this clock have passed."""
        ...


def thread_cpu() -> float:
    """CPU seconds of the calling thread: what a request costs the event loop's core, whoever else shares it."""
    return time.thread_time()


class SystemClock:
    """The process's monotonic clock; looked up at each call, so it is the one the interpreter has now."""

    def __call__(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def sleeper(clock: Now) -> Callable[[float], Awaitable[None]]:
    """How a component given ``clock`` waits: the clock's own sleep, or the event loop's for a clock that only
    reads time (a test's ``lambda: t``, which then drives expiry by hand)."""
    return clock.sleep if isinstance(clock, Clock) else asyncio.sleep


async def wait_for(clock: Now, aw: Awaitable[T], timeout_s: float | None) -> T:
    """``asyncio.wait_for`` on ``clock``'s time: ``TimeoutError`` (and ``aw`` cancelled) once ``timeout_s`` of it
    passed. The system clock's is asyncio's own."""
    if timeout_s is None or isinstance(clock, SystemClock) or not isinstance(clock, Clock):
        return await asyncio.wait_for(aw, timeout_s)
    task = asyncio.ensure_future(aw)
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        timer.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise TimeoutError(f"not done within {timeout_s} s of the clock")


class ManualClock:
    """Virtual time: it moves only by :meth:`advance`, which wakes the sleepers whose time has come, in order of
    their wake-up time (sleepers of equal time in the order they slept)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def __call__(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # a zero sleep still yields to the loop, as asyncio.sleep(0) does
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + seconds, next(self._seq), fut))
        await fut

    @property
    def sleepers(self) -> int:
        """Tasks waiting on this clock (cancelled ones excluded)."""
        return sum(1 for *_, f in self._sleepers if not f.done())

    def next_wake(self) -> float | None:
        """When the earliest live sleeper wakes (None: nobody sleeps)."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds`` and wakes every sleeper due by then (they run at the loop's next
        turn: ``await asyncio.sleep(0)`` after advancing lets them)."""
        if seconds < 0:
            raise ValueError(f"time does not run backwards ({seconds} s)")
        self.t += seconds
        while self._sleepers and self._sleepers[0][0] <= self.t:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

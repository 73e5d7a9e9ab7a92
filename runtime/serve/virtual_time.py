"""Virtual time for the serving control plane: an asyncio event loop whose clock jumps instead of waiting.

The simulator (``grstack bench serve --simulate``) runs the real router, trigger, rankers, schedulers and caches in
one process; only the tensor math is replaced by costs (runtime/serve/backend_cost.py). For the latencies to be
those of the costs and not of this host's Python, time must not pass while the control plane runs and must pass
exactly by the costs while compute runs:

* :class:`VirtualTimeLoop` is a selector event loop whose ``time()`` is a number it owns. When nothing is ready
  it advances that number to the next timer instead of blocking, so every ``asyncio.sleep``, ``wait_for`` and
  ``call_later`` of the control plane runs on virtual time unchanged. Sockets still work (a ready socket is
  served before time moves); nothing else in the process needs to know.
* :class:`VirtualClock` is the :class:`~grstack.runtime.serve.clock.Clock` the components are given. A backend's
  synchronous call says what it cost with :meth:`VirtualClock.charge`; reads of the clock inside the call see
  that time pass (the scheduler times its steps with them), and :class:`VirtualComputeRunner` then sleeps it off
  on the loop while holding one of the replica's cores, so the replica's other work waits as a busy core makes
  it wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from grstack.runtime.serve.clock import Now

T = TypeVar("T")

# With nothing scheduled, how long a real wait for another thread's call_soon_threadsafe may take before the
# simulation is declared stuck (every task waits on something nothing will ever do).
STUCK_AFTER_S = 30.0


class VirtualTimeStuck(RuntimeError):
    """Nothing is ready, no timer is due and no other thread woke the loop: the simulation cannot go on."""


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real file descriptors without waiting; a wait of ``timeout`` becomes a jump of the loop's clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only another thread can make progress
            events = super().select(STUCK_AFTER_S)
            if not events:
                raise VirtualTimeStuck(f"no timer, nothing ready and no wake-up within {STUCK_AFTER_S:g} s of "
                                       "real time")
            return events
        events = super().select(0)
        if not events and timeout > 0:
            self._loop.advance(timeout)
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual seconds from ``start``; :meth:`advance` is how time moves (the loop calls it)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time does not run backwards ({seconds} s)")
        self._now += seconds


def run_virtual(main: Callable[[], Any], start: float = 0.0) -> Any:
    """``asyncio.run`` of the coroutine ``main()`` on a fresh :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start)) as runner:
        return runner.run(main())


class VirtualClock:
    """The loop's time plus what the compute call now running has charged (zero between calls)."""

    def __init__(self) -> None:
        self._charged = 0.0

    def __call__(self) -> float:
        return asyncio.get_running_loop().time() + self._charged

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def charge(self, seconds: float) -> None:
        """The synchronous call now running costs ``seconds`` more."""
        if seconds < 0:
            raise ValueError(f"a cost cannot be negative ({seconds} s)")
        self._charged += seconds

    def settle(self) -> float:
        """What the call charged, now owed to the loop (the runner sleeps it); the charge starts again at 0."""
        owed, self._charged = self._charged, 0.0
        return owed


class VirtualComputeRunner:
    """A replica's compute thread on virtual time: runs ``fn`` at once (it charges its cost to ``clock``), then
    holds one of ``cores`` for that long. ``cores`` is shared with the replica's request handling when both run
    on the same cores (:class:`~grstack.runtime.serve.virtual_time.CoreSet`)."""

    def __init__(self, clock: VirtualClock, cores: CoreSet) -> None:
        self.clock = clock
        self.cores = cores
        self.cpu_clock: Now | None = None  # no thread runs the math: there is no CPU to read

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.cores.compute(self.clock, fn, *args, thread=self)  # this runner: one compute thread

    def close(self) -> None:
        return None


class CoreSet:
    """``n`` cores of one replica: work holds one for its duration, first come first served (a non-preemptive
    approximation of the kernel's time slicing, stated as such in docs/bench-serve.md)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"a replica needs at least one core, got {n}")
        self.n = n
        self._sem = asyncio.Semaphore(n)
        self.busy_s = 0.0

    def held(self) -> _Held:
        return _Held(self)

    async def compute(self, clock: VirtualClock, fn: Callable[..., T], *args: Any, thread: Hashable = None) -> T:
        """Runs ``fn`` (it charges its cost to ``clock``) once a core is free, then holds it that long. ``thread``:
        the thread it runs on (a held core already runs one piece of work at a time)."""
        async with self.held():
            try:
                out = fn(*args)
            finally:
                owed = clock.settle()
            if owed > 0:
                await asyncio.sleep(owed)
        return out

    async def spend(self, seconds: float, thread: Hashable = None) -> None:
        """Holds one core for ``seconds`` of virtual time (a request's CPU on the replica's event loop)."""
        if seconds <= 0:
            return
        async with self.held():
            await asyncio.sleep(seconds)


class _Held:
    def __init__(self, cores: CoreSet) -> None:
        self._cores = cores
        self._t0 = 0.0

    async def __aenter__(self) -> None:
        await self._cores._sem.acquire()
        self._t0 = asyncio.get_running_loop().time()

    async def __aexit__(self, *exc: object) -> None:
        self._cores.busy_s += asyncio.get_running_loop().time() - self._t0
        self._cores._sem.release()


class SharedCores(CoreSet):
    """``n`` cores shared the way the kernel's scheduler shares them (processor sharing): every piece of work
    runs at once, each at rate ``min(1, n / jobs)``, so a request's CPU on the event loop is slowed by a
    compute step beside it rather than queued behind all of it (what :class:`CoreSet` approximates). Work on one
    ``thread`` (the compute thread, the event loop) runs one piece at a time, as a thread does."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self._left: dict[asyncio.Future[None], float] = {}  # each running job's remaining seconds of work
        self._t = 0.0  # when ``_left`` was last brought up to date
        self._timer: asyncio.TimerHandle | None = None
        self._threads: dict[Hashable, asyncio.Lock] = {}

    def _thread(self, thread: Hashable) -> asyncio.Lock | contextlib.nullcontext[None]:
        return contextlib.nullcontext() if thread is None else self._threads.setdefault(thread, asyncio.Lock())

    async def compute(self, clock: VirtualClock, fn: Callable[..., T], *args: Any, thread: Hashable = None) -> T:
        """Runs ``fn`` once ``thread`` is free, then its charged cost at its share of the cores."""
        async with self._thread(thread):
            try:
                out = fn(*args)
            finally:
                owed = clock.settle()
            await self._work(owed)
        return out

    async def spend(self, seconds: float, thread: Hashable = None) -> None:
        """``seconds`` of work on ``thread`` (once it is free) at its share of the cores."""
        if seconds <= 0:
            return
        async with self._thread(thread):
            await self._work(seconds)

    def _rate(self) -> float:
        return min(1.0, self.n / len(self._left)) if self._left else 0.0

    def _advance(self) -> None:
        now = asyncio.get_running_loop().time()
        done = (now - self._t) * self._rate()
        self.busy_s += (now - self._t) * min(self.n, len(self._left))
        self._t = now
        for fut in list(self._left):
            self._left[fut] -= done
            if self._left[fut] <= 1e-12:
                del self._left[fut]
                if not fut.done():
                    fut.set_result(None)

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._left:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(self._t + min(self._left.values()) / self._rate(), self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        self._reschedule()

    async def _work(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self._advance()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._left[fut] = seconds
        self._reschedule()
        try:
            await fut
        finally:
            if fut in self._left:  # cancelled: its share goes back to the others
                self._advance()
                self._left.pop(fut, None)
                self._reschedule()

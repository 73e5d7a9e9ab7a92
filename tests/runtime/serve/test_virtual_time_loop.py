"""Virtual time: the loop jumps to its next timer, charged compute holds a core and passes inside the call."""

from __future__ import annotations

import asyncio
import time

import pytest

from grstack.runtime.serve.clock import wait_for
from grstack.runtime.serve.virtual_time import (
    CoreSet,
    SharedCores,
    VirtualClock,
    VirtualComputeRunner,
    VirtualTimeLoop,
    VirtualTimeStuck,
    run_virtual,
)

pytestmark = pytest.mark.unit


def test_sleeps_jump_without_waiting() -> None:
    async def main() -> tuple[float, list[str]]:
        order: list[str] = []

        async def nap(name: str, s: float) -> None:
            await asyncio.sleep(s)
            order.append(name)

        await asyncio.gather(nap("long", 3600.0), nap("short", 1.5), nap("mid", 60.0))
        return asyncio.get_running_loop().time(), order

    t0 = time.monotonic()
    now, order = run_virtual(main)
    assert now == pytest.approx(3600.0)
    assert order == ["short", "mid", "long"]
    assert time.monotonic() - t0 < 30  # an hour of virtual time; a guard against real waiting, not a benchmark


def test_wait_for_times_out_on_virtual_time() -> None:
    async def main() -> float:
        clock = VirtualClock()
        with pytest.raises(TimeoutError):
            await wait_for(clock, asyncio.sleep(10.0), 2.0)
        return clock()

    assert run_virtual(main) == pytest.approx(2.0)


def test_charge_passes_inside_the_call_and_is_slept_off_on_a_core() -> None:
    async def main() -> tuple[list[float], float, float]:
        clock = VirtualClock()
        cores = CoreSet(1)
        runner = VirtualComputeRunner(clock, cores)
        seen: list[float] = []

        def step(cost: float) -> float:
            t0 = clock()
            clock.charge(cost)
            seen.append(clock() - t0)
            return cost

        # two calls on one core run one after the other; a request's CPU on the same core waits for both
        a = asyncio.ensure_future(runner.run(step, 0.25))
        b = asyncio.ensure_future(runner.run(step, 0.5))
        await asyncio.sleep(0)
        cpu_started = asyncio.ensure_future(cores.spend(0.1))
        await asyncio.gather(a, b, cpu_started)
        return seen, clock(), cores.busy_s

    seen, now, busy = run_virtual(main)
    assert seen == [pytest.approx(0.25), pytest.approx(0.5)]
    assert now == pytest.approx(0.85)
    assert busy == pytest.approx(0.85)


def test_two_cores_overlap() -> None:
    async def main() -> float:
        cores = CoreSet(2)
        await asyncio.gather(cores.spend(1.0), cores.spend(1.0), cores.spend(1.0))
        return asyncio.get_running_loop().time()

    assert run_virtual(main) == pytest.approx(2.0)


def test_a_failing_call_owes_nothing_afterwards() -> None:
    async def main() -> float:
        clock = VirtualClock()
        runner = VirtualComputeRunner(clock, CoreSet(1))

        def boom() -> None:
            clock.charge(1.0)
            raise RuntimeError("bad batch")

        with pytest.raises(RuntimeError):
            await runner.run(boom)
        return clock()

    assert run_virtual(main) == pytest.approx(0.0)  # the error surfaced at once; nothing left charged


def test_negative_costs_and_time_are_refused() -> None:
    with pytest.raises(ValueError):
        VirtualClock().charge(-1.0)
    loop = VirtualTimeLoop()
    try:
        with pytest.raises(ValueError):
            loop.advance(-0.5)
    finally:
        loop.close()


def test_a_simulation_that_cannot_progress_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import grstack.runtime.serve.virtual_time as vt

    monkeypatch.setattr(vt, "STUCK_AFTER_S", 0.05)

    async def main() -> None:
        await asyncio.get_running_loop().create_future()  # nothing will ever set it

    with pytest.raises(VirtualTimeStuck):
        run_virtual(main)


def test_shared_cores_share_as_the_kernel_does() -> None:
    async def main() -> tuple[dict[str, float], float]:
        clock = VirtualClock()
        cores = SharedCores(1)
        runner = VirtualComputeRunner(clock, cores)
        done: dict[str, float] = {}

        def step(cost: float) -> float:
            clock.charge(cost)
            return cost

        async def timed(name: str, aw) -> None:
            await aw
            done[name] = asyncio.get_running_loop().time()

        # a 1 s compute step; 0.1 s later a request's 0.1 s of CPU: both run at half speed until it is done
        await asyncio.gather(timed("step", runner.run(step, 1.0)),
                             timed("request", _after(0.1, cores.spend(0.1))),
                             timed("second step", _after(0.05, runner.run(step, 0.5))))  # the one compute thread
        return done, cores.busy_s

    done, busy = run_virtual(main)
    assert done["request"] == pytest.approx(0.3)  # not behind the whole step, as CoreSet would have it (1.1)
    assert done["step"] == pytest.approx(1.1)
    assert done["second step"] == pytest.approx(1.6)  # after the first: one compute thread
    assert busy == pytest.approx(1.6)


def test_shared_cores_run_up_to_n_jobs_at_full_speed() -> None:
    async def main() -> list[float]:
        cores = SharedCores(2)
        loop = asyncio.get_running_loop()
        ends: list[float] = []

        async def job(s: float) -> None:
            await cores.spend(s)
            ends.append(loop.time())

        await asyncio.gather(job(1.0), job(1.0), job(1.0))  # 3 jobs on 2 cores: each at 2/3
        return ends

    assert run_virtual(main) == [pytest.approx(1.5)] * 3


def test_a_cancelled_job_gives_its_share_back() -> None:
    async def main() -> float:
        cores = SharedCores(1)
        loop = asyncio.get_running_loop()
        other = asyncio.ensure_future(cores.spend(10.0))
        mine = asyncio.ensure_future(cores.spend(1.0))
        await asyncio.sleep(1.0)  # both at half speed: 0.5 s of work each
        other.cancel()
        await mine
        return loop.time()

    assert run_virtual(main) == pytest.approx(1.5)


async def _after(delay: float, aw):
    await asyncio.sleep(delay)
    return await aw

"""The serving control plane on an injected virtual clock: TTLs, budget windows, deadlines, ejections, leases and
the router's loops move only when the test advances time, and nothing sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from grstack.runtime.serve.cache import TieredKVCache
from grstack.runtime.serve.clock import Clock, ManualClock, SystemClock, wait_for
from grstack.runtime.serve.engine import PrefixKV, RankItem, RelayEngine
from grstack.runtime.serve.placement import Event, MemoryPlacementStore, Replica
from grstack.runtime.serve.router import Router, RouterConfig
from grstack.runtime.serve.scheduler import ComputeScheduler, DeadlineExceeded
from grstack.runtime.serve.transport_local import InProcessTransport
from grstack.runtime.serve.trigger import LatencyModel, SequenceAwareTrigger, TriggerConfig

pytestmark = pytest.mark.unit

MODEL = LatencyModel(lengths=(100, 2000), full_ms=(10.0, 200.0), cached_ms=(1.0, 1.0), prefill_ms=(10.0, 10.0),
                     kv_bytes_per_token=100)


async def settle(done: Callable[[], bool], turns: int = 200) -> None:
    """Lets the event loop run (no time passes on the virtual clock) until ``done`` holds."""
    for _ in range(turns):
        if done():
            return
        await asyncio.sleep(0)
    assert done(), "the loop did not get there without time passing"


def kv(n: int) -> PrefixKV:
    t = torch.zeros((1, n, 2))
    return PrefixKV([t], [t.clone()], torch.arange(n))


def test_both_clocks_are_clocks() -> None:
    assert isinstance(SystemClock(), Clock) and isinstance(ManualClock(), Clock)
    assert not isinstance(lambda: 0.0, Clock)  # a plain reader: enough for a component that only reads time


async def test_manual_clock_wakes_sleepers_in_time_order_only_when_advanced() -> None:
    clock = ManualClock(10.0)
    woke: list[str] = []

    async def nap(name: str, s: float) -> None:
        await clock.sleep(s)
        woke.append(f"{name}@{clock()}")

    tasks = [asyncio.ensure_future(nap(n, s)) for n, s in (("late", 3.0), ("early", 1.0), ("also-early", 1.0))]
    await settle(lambda: clock.sleepers == 3)
    assert woke == [] and clock.next_wake() == 11.0
    clock.advance(1.0)
    await settle(lambda: len(woke) == 2)
    assert woke == ["early@11.0", "also-early@11.0"]  # equal wake times: in the order they slept
    clock.advance(1.5)
    await asyncio.sleep(0)
    assert len(woke) == 2 and clock.next_wake() == 13.0
    clock.advance(0.5)
    await asyncio.gather(*tasks)
    assert woke[-1] == "late@13.0" and clock.sleepers == 0
    with pytest.raises(ValueError, match="backwards"):
        clock.advance(-1.0)


async def test_wait_for_times_out_on_the_virtual_clock_only() -> None:
    clock = ManualClock()
    never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(wait_for(clock, never, 2.0))
    await settle(lambda: clock.sleepers == 1)
    clock.advance(1.0)
    await asyncio.sleep(0)
    assert not waiting.done()
    clock.advance(1.0)
    with pytest.raises(TimeoutError):
        await waiting
    assert never.cancelled()
    soon: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    answered = asyncio.ensure_future(wait_for(clock, soon, 2.0))
    await settle(lambda: clock.sleepers == 1)
    soon.set_result(7)
    assert await answered == 7 and clock.sleepers == 0  # its timer is gone with it


def test_trigger_load_budget_window_slides_on_the_virtual_clock() -> None:
    clock = ManualClock(1000.0)
    cfg = TriggerConfig(slo_ms=100.0, risk_fraction=0.5, cache_budget_bytes=10**9, prefill_budget_ms=30.0,
                        window_s=1.0)
    t = SequenceAwareTrigger(MODEL, cfg, clock=clock)
    assert [t.decide(f"u{i}", "h", 1000).reason for i in range(4)] == ["admitted"] * 3 + ["load-budget"]
    clock.advance(0.75)
    assert t.decide("v", "h", 1000).reason == "load-budget"  # still inside the window
    clock.advance(0.25)
    assert t.decide("v", "h", 1000).admitted  # the first admissions left the window


def test_cache_dram_ttl_expires_on_the_virtual_clock() -> None:
    clock = ManualClock(100.0)
    c = TieredKVCache(device_bytes=240, dram_bytes=10_000, dram_ttl_s=5, clock=clock)
    c.put("a", "v1", kv(10))
    c.put("b", "v1", kv(10))  # a -> DRAM, expires at 105
    clock.advance(4.5)
    assert c.tier_of("a", "v1") == "dram"
    clock.advance(0.5)
    assert c.tier_of("a", "v1") is None


def rank_item(eng: RelayEngine, seed: int, n_long: int) -> RankItem:
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 300, n_long + 4)
    ts = 1_600_000_000 + np.cumsum(rng.integers(1, 999, n_long + 4))
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:], [1, 2, 3], int(ts[-1]))


async def test_scheduler_deadlines_and_timings_are_virtual(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock(0.0)
    sched = ComputeScheduler(eng, max_batch=4, clock=clock, on_batch=lambda _n: clock.advance(0.25))
    late = asyncio.ensure_future(sched.rank_full(rank_item(eng, 1, 6), deadline=1.0))
    on_time = asyncio.ensure_future(sched.rank_full(rank_item(eng, 2, 6), deadline=3.0))
    await asyncio.sleep(0)
    clock.advance(2.0)  # past the first deadline before any compute ran
    sched.start()
    with pytest.raises(DeadlineExceeded):
        await late
    _, timing = await on_time
    await sched.stop()
    assert sched.dropped_expired == 1
    assert timing.queue_ms == pytest.approx(2000.0) and timing.compute_ms == pytest.approx(250.0)


class CostedBackend:
    """A stand-in compute backend: the engine's results, each call taking ``cost_s`` of the virtual clock (what
    a cost-model backend does, minus the model)."""

    def __init__(self, eng: RelayEngine, clock: ManualClock, cost_s: float) -> None:
        self.eng, self.clock, self.cost_s = eng, clock, cost_s
        self.chunk = eng.chunk
        self.empty_prefix, self.prefix_tokens, self.item_tokens = eng.empty_prefix, eng.prefix_tokens, eng.item_tokens
        self.extend, self.prefill_tokens, self.rank_encode = eng.extend, eng.prefill_tokens, eng.rank_encode

    def _cost(self) -> None:
        self.clock.t += self.cost_s  # on the compute thread; nothing sleeps on the clock meanwhile

    def extend_many(self, *args: Any) -> list[PrefixKV]:
        out = self.eng.extend_many(*args)
        self._cost()
        return out

    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        out = self.eng.rank_cached(prefixes, reqs)
        self._cost()
        return out

    def rank_full(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        out = self.eng.rank_full(reqs)
        self._cost()
        return out


async def test_scheduler_runs_on_a_stand_in_backend_and_learns_its_costs(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock()
    sched = ComputeScheduler(CostedBackend(eng, clock, 0.04), max_batch=1, clock=clock)
    sched.start()
    for seed in range(10):
        item = rank_item(eng, seed, 6)
        logits, timing = await sched.rank_full(item)
        assert timing.compute_ms == pytest.approx(40.0)
        assert torch.allclose(logits, eng.rank_encode([item])[0], atol=1e-5, rtol=0)
    await sched.stop()
    assert sched.full_cost.predict(6) == pytest.approx(0.04)  # the admission policy predicts what it measured
    assert sched.compute_s["rank_full"] == pytest.approx(0.4)


async def test_router_ejection_ends_when_virtual_time_passes() -> None:
    clock = ManualClock(100.0)
    router = Router(RouterConfig(outlier_consecutive_failures=1, outlier_base_ejection_s=5.0,
                                 outlier_latency_factor=None), clock=clock)
    router.apply(Event("snapshot", replicas=[Replica("a", "http://a"), Replica("b", "http://b")], placements=[]))
    router.record_failure("a")
    assert router.ejected == {"a": 105.0} and router.up_replicas() == ["b"]
    clock.advance(4.0)
    router.route("u")
    assert "a" in router.ejected
    clock.advance(1.0)
    order, _ = router.route("u")
    assert "a" in order and not router.ejected


async def test_router_health_loop_probes_on_the_virtual_clock() -> None:
    clock = ManualClock()
    ready = SimpleNamespace(ready=True, replica_id="a")
    transport = InProcessTransport({"mem://a": ready})  # type: ignore[dict-item]
    router = Router(RouterConfig(health_interval_s=1.0), transport=transport, clock=clock)
    router.apply(Event("snapshot", replicas=[Replica("a", "mem://a"), Replica("b", "mem://b")], placements=[]))
    loop = asyncio.ensure_future(router._health_loop())
    await settle(lambda: clock.sleepers == 1)
    assert router.down == {"b"}  # nothing answers at mem://b
    transport.services["mem://b"] = SimpleNamespace(ready=True, replica_id="b")  # type: ignore[assignment]
    await asyncio.sleep(0)
    assert router.down == {"b"}  # no probe until the interval has passed
    clock.advance(1.0)
    await settle(lambda: not router.down)
    assert router.up_replicas() == ["a", "b"]
    loop.cancel()


async def test_memory_store_lease_expires_on_the_virtual_clock() -> None:
    clock = ManualClock()
    store = MemoryPlacementStore(clock, sweep_s=0.5)
    await store.register(Replica("r", "mem://r"), ttl_s=3.0)
    store.stop_keepalive("r")  # crashed: its lease is no longer refreshed
    def sweeper_waits() -> bool:
        wake = clock.next_wake()
        return wake is not None and wake > clock()

    await settle(sweeper_waits)
    for _ in range(5):  # t = 2.5: five sweeps, the lease (3 s) still runs
        clock.advance(0.5)
        await settle(sweeper_waits)
    assert "r" in await store.replicas()
    clock.advance(0.5)  # t = 3.0: the lease ran out, and the sweep that wakes now sees it
    await settle(sweeper_waits)
    assert await store.replicas() == {}
    await store.close()

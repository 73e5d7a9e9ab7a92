"""The ranker's compute loop batches concurrent cached ranks and interleaves prefill chunks with ranks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.serve.scheduler import ComputeScheduler, PredictedLate, StepCost

pytestmark = pytest.mark.unit


def request(eng: RelayEngine, rng: np.random.Generator, n_long: int):
    items = rng.integers(1, 300, n_long + 4)
    ts = np.arange(n_long + 4) * 60
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:], [1, 2, 3], int(ts[-1]))


async def test_queued_cached_ranks_run_as_one_batch(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    rng = np.random.default_rng(0)
    reqs = [request(eng, rng, n) for n in (5, 20, 33, 12, 40)]
    prefixes = [eng.prefill(r.long_items, r.long_ts) for r in reqs]
    batches: list[int] = []
    sched = ComputeScheduler(eng, max_batch=4, on_batch=batches.append)
    pending = [asyncio.ensure_future(sched.rank_cached(p, r)) for p, r in zip(prefixes, reqs, strict=True)]
    await asyncio.sleep(0)  # all five are queued before the loop starts
    sched.start()
    results = await asyncio.gather(*pending)
    await sched.stop()
    assert batches == [4, 1]
    for (logits, timing), r in zip(results, reqs, strict=True):
        assert torch.allclose(logits, eng.rank_encode([r])[0], atol=1e-5, rtol=0)
        assert timing.compute_ms > 0


async def test_ranks_overtake_a_long_prefill_between_its_chunks(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=4)
    rng = np.random.default_rng(1)
    long = request(eng, rng, 40)  # 10 chunks
    short = request(eng, rng, 6)
    prefix = eng.prefill(short.long_items, short.long_ts)
    order: list[str] = []
    sched = ComputeScheduler(eng, prefill_every=100)
    sched.start()
    pre = asyncio.ensure_future(sched.prefill(long.long_items, long.long_ts))
    while sched.depth()["prefills"] == 0:
        await asyncio.sleep(0)
    pre.add_done_callback(lambda _: order.append("prefill"))
    ranks = [asyncio.ensure_future(sched.rank_cached(prefix, short)) for _ in range(3)]
    for r in ranks:
        r.add_done_callback(lambda _: order.append("rank"))
    kv, _ = await pre
    await asyncio.gather(*ranks)
    await sched.stop()
    assert order.index("prefill") == 3  # the ranks did not wait for all ten chunks
    assert torch.allclose(kv.keys[0], eng.prefill(long.long_items, long.long_ts).keys[0], atol=1e-6)


def measured(per_unit: float, overhead: float = 0.0) -> StepCost:
    """A step cost model fed exact steps of ``overhead + per_unit·n`` seconds."""
    cost = StepCost()
    for n in range(1, 13):
        cost.add(n, overhead + per_unit * n)
    return cost


def test_step_cost_fits_overhead_and_per_unit_cost_once_warm() -> None:
    cost = StepCost(warm=3)
    cost.add(4, 0.006)
    cost.add(8, 0.010)
    assert cost.predict(8) == 0.0  # two steps: not warm, admits everything
    cost.add(2, 0.004)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.001)  # 2 ms a step + 1 ms a unit
    assert cost.predict(16) == pytest.approx(0.018)
    cost = measured(0.001, overhead=0.003)
    assert cost.dev == pytest.approx(0.0, abs=1e-9)  # exact steps: no error
    cost.add(6, 0.019)  # one step 10 ms slower than the line: the error estimate grows
    assert cost.dev > 0.0005
    same = StepCost(warm=2)  # one size only: a line through the origin
    for _ in range(4):
        same.add(5, 0.010)
    assert same.coefficients() == (0.0, pytest.approx(0.002))
    flat = StepCost(warm=2)  # bigger steps measured faster: a constant, never a negative slope
    flat.add(1, 0.010)
    flat.add(10, 0.006)
    assert flat.coefficients() == (pytest.approx((0.9 * 0.010 + 0.006) / 1.9), 0.0)  # their weighted mean


async def test_a_rank_predicted_to_miss_its_deadline_is_refused_at_admission(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    rng = np.random.default_rng(2)
    reqs = [request(eng, rng, 12) for _ in range(6)]
    prefixes = [eng.prefill(r.long_items, r.long_ts) for r in reqs]
    clock = [100.0]
    sched = ComputeScheduler(eng, max_batch=2, clock=lambda: clock[0], admission_margin_s=0.005)
    sched.hit_cost = measured(0.010)  # 10 ms a cached rank, 1 ms a prefix token, no error
    sched.token_cost = measured(0.001)
    queued = [asyncio.ensure_future(sched.rank_cached(p, r, deadline=200.0)) for p, r in zip(prefixes[:4], reqs[:4], strict=True)]
    await asyncio.sleep(0)
    assert sched.depth()["hits"] == 4
    # 4 hits ahead (40 ms, two steps of 2) + its own 10 ms + the 5 ms margin: due in 54 ms is late, in 56 is not
    with pytest.raises(PredictedLate, match="ms after its deadline"):
        await sched.rank_cached(prefixes[4], reqs[4], deadline=100.054)
    assert sched.depth()["hits"] == 4  # refused before it was queued: nothing to compute, nothing lost
    ok = asyncio.ensure_future(sched.rank_cached(prefixes[4], reqs[4], deadline=100.056))
    await asyncio.sleep(0)
    assert sched.depth()["hits"] == 5
    # a miss (longer than a chunk: computed in chunks, then a cached-prefix rank) waits behind the 5 hits:
    # 50 ms + its tokens at 1 ms + 10 ms for its rank + the margin
    due = 0.050 + len(eng.item_tokens(reqs[5])) * 0.001 + 0.010 + 0.005
    with pytest.raises(PredictedLate):
        await sched.rank_full(reqs[5], deadline=100.0 + due - 0.001)
    miss = asyncio.ensure_future(sched.rank_full(reqs[5], deadline=100.0 + due + 0.001))
    await asyncio.sleep(0)
    assert sched.depth()["misses"] == 1
    # no deadline, or no prediction: admitted whatever is queued
    free = asyncio.ensure_future(sched.rank_cached(prefixes[0], reqs[0]))
    sched.start()
    results = await asyncio.gather(*queued, ok, miss, free)
    await sched.stop()
    assert len(results) == 7
    assert sched.hit_cost.samples > 12  # the measured steps update the model


async def test_without_measured_costs_every_rank_is_admitted(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    rng = np.random.default_rng(3)
    r = request(eng, rng, 12)
    prefix = eng.prefill(r.long_items, r.long_ts)
    clock = [5.0]
    sched = ComputeScheduler(eng, clock=lambda: clock[0], admission_margin_s=0.005)
    pending = [asyncio.ensure_future(sched.rank_cached(prefix, r, deadline=5.006)) for _ in range(20)]
    await asyncio.sleep(0)
    assert sched.depth()["hits"] == 20  # a ranker that has not measured its speed yet refuses nothing
    for p in pending:
        p.cancel()

"""The ranker's compute loop batches concurrent cached ranks and interleaves prefill chunks with ranks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RelayEngine
from grstack.runtime.serve.scheduler import ComputeScheduler

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

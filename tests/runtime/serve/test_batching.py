"""Batched cache misses and prefills: one compute step advances the next chunk of several queued users in one
jagged model call, with the same results as one at a time, the same priorities, deadlines and failures."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grstack.runtime.serve.engine import RankItem, RelayEngine
from grstack.runtime.serve.scheduler import ComputeScheduler, DeadlineExceeded, step_shares

pytestmark = pytest.mark.unit

TOL = 1e-5


def request(eng: RelayEngine, seed: int, n_long: int) -> RankItem:
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 300, n_long + 4)
    ts = 1_600_000_000 + np.cumsum(rng.integers(1, 999, n_long + 4))
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:], [1, 2, 3], int(ts[-1]))


def counting(eng: RelayEngine, tokens: list[int] | None = None) -> list[int]:
    """Records how many sequences each extend_many call computed together (and, into ``tokens``, how many new
    tokens in all)."""
    calls: list[int] = []
    orig = eng.extend_many

    def wrapped(prefixes, items, ts, *rest):
        calls.append(sum(1 for x in items if len(x)))
        if tokens is not None:
            tokens.append(sum(len(x) for x in items))
        return orig(prefixes, items, ts, *rest)

    eng.extend_many = wrapped  # type: ignore[method-assign]
    return calls


def test_step_shares_fill_the_budget_first_come_first_served() -> None:
    assert step_shares([24, 24, 24], max_jobs=8, chunk=8, budget=16) == [16]
    assert step_shares([8, 24, 24], max_jobs=8, chunk=8, budget=16) == [8, 8]
    assert step_shares([5, 5, 5, 5], max_jobs=3, chunk=8, budget=100) == [5, 5, 5]  # at most max_jobs
    assert step_shares([40, 3], max_jobs=8, chunk=8, budget=None) == [8, 3]  # no budget: a chunk each
    assert step_shares([], max_jobs=8, chunk=8, budget=16) == []


async def test_a_burst_of_misses_finishes_one_step_at_a_time(kit: SimpleNamespace) -> None:
    """Four 16-token misses, 16 tokens a step: one answered per step (first come, first served). Processor
    sharing (every miss one chunk a step) would answer two at step 2 and two at step 4."""
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = Clock()

    def tick(_: int) -> None:  # each compute step takes 1 s of the scheduler's clock
        clock.t += 1.0

    sched = ComputeScheduler(eng, max_batch=8, max_step_tokens=16, on_batch=tick, clock=clock)
    futs = [asyncio.ensure_future(sched.rank_full(request(eng, s, 16))) for s in range(4)]
    await asyncio.sleep(0)
    sched.start()
    got = await asyncio.gather(*futs)
    await sched.stop()
    # answered at the end of steps 1, 2, 3, 4 (queued at 0): queue + compute time
    assert [round(t.queue_ms + t.compute_ms) for _, t in got] == [1000, 2000, 3000, 4000]
    for (logits, _), s in zip(got, range(4), strict=True):  # the same scores as one full inference each
        r = request(eng, s, 16)
        assert torch.allclose(logits, eng.rank_encode([r])[0], atol=TOL, rtol=0)


async def test_batched_misses_and_prefills_equal_one_at_a_time(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    calls = counting(eng)
    misses = [request(eng, s, n) for s, n in ((1, 30), (2, 17), (3, 40), (4, 9))]
    prefills = [request(eng, s, n) for s, n in ((5, 25), (6, 33))]
    base = eng.prefill(misses[2].long_items[:20], misses[2].long_ts[:20])  # one miss extends an older prefix
    sched = ComputeScheduler(eng, max_batch=8, prefill_every=100)
    m = [asyncio.ensure_future(sched.rank_full(r)) for r in misses[:2]]
    m.append(asyncio.ensure_future(sched.rank_extend(misses[2], base)))
    m.append(asyncio.ensure_future(sched.rank_full(misses[3])))
    p = [sched.submit_prefill(r.long_items, r.long_ts) for r in prefills]
    await asyncio.sleep(0)  # all queued before the loop starts
    sched.start()
    got_m = await asyncio.gather(*m)
    got_p = await asyncio.gather(*p)
    await sched.stop()
    assert calls[:4] == [4, 4, 3, 1]  # misses: 30, 17, 20 left, 9 tokens in chunks of 8, all four together
    assert calls[4:] == [2, 2, 2, 2, 1]  # then the prefills, together (25 and 33 tokens)
    for out, r in zip(got_m, misses, strict=True):
        assert torch.allclose(out[0], eng.rank_encode([r])[0], atol=TOL, rtol=0)
    _, kv, _ = got_m[2]
    assert kv.length == 40 and torch.allclose(kv.keys[1], eng.prefill(misses[2].long_items,
                                                                    misses[2].long_ts).keys[1], atol=TOL, rtol=0)
    for (kv, _), r in zip(got_p, prefills, strict=True):
        full = eng.prefill(r.long_items, r.long_ts)
        for a, b in zip(kv.keys + kv.values, full.keys + full.values, strict=True):
            assert torch.allclose(a, b, atol=TOL, rtol=0)
    assert sched.tokens_computed == 30 + 17 + 20 + 9 + 25 + 33
    assert sched.tokens_without_incremental == 30 + 17 + 40 + 9 + 25 + 33 and sched.incremental_prefills == 1


async def test_step_token_bound_and_priorities_hold_and_prefills_do_not_starve(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    tokens: list[int] = []
    calls = counting(eng, tokens)
    sched = ComputeScheduler(eng, max_batch=8, prefill_every=2, max_step_tokens=16)
    order: list[str] = []
    p = [sched.submit_prefill(request(eng, s, 24).long_items, request(eng, s, 24).long_ts) for s in (1, 2, 3)]
    m = [asyncio.ensure_future(sched.rank_full(request(eng, s, 24))) for s in (4, 5, 6)]
    for name, futs in (("p", p), ("m", m)):
        for f in futs:
            f.add_done_callback(lambda _f, name=name: order.append(name))
    await asyncio.sleep(0)
    assert sched.backlog_tokens() == 6 * 24
    sched.start()
    await asyncio.gather(*m)
    left = sched.backlog_tokens()  # the prefills' tokens still to compute when the last miss is answered
    await asyncio.gather(*p)
    await sched.stop()
    assert max(tokens) == 16 and max(calls) == 2  # 16 tokens a step, from one job or two
    assert order[:2] == ["m", "m"]  # the misses first, though the prefills were queued earlier
    assert 0 < left < 3 * 24  # ... but after two miss steps one prefill step ran: the prefills advanced
    assert sched.tokens_computed == 6 * 24 and sched.backlog_tokens() == 0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_a_miss_past_its_deadline_is_dropped_between_chunks(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    calls = counting(eng)
    clock = Clock()

    def tick(_: int) -> None:  # each compute step takes 0.6 s of the scheduler's clock
        clock.t += 0.6

    sched = ComputeScheduler(eng, max_batch=8, on_batch=tick, clock=clock)
    late = asyncio.ensure_future(sched.rank_full(request(eng, 1, 40), deadline=1.0))  # 5 chunks
    ok = asyncio.ensure_future(sched.rank_full(request(eng, 2, 24)))  # 3 chunks
    dead = asyncio.ensure_future(sched.rank_full(request(eng, 3, 24), deadline=0.0))  # expired on arrival
    await asyncio.sleep(0)
    sched.start()
    with pytest.raises(DeadlineExceeded):
        await late
    with pytest.raises(DeadlineExceeded):
        await dead
    logits, _ = await ok
    await sched.stop()
    assert calls == [2, 2, 1]  # `late` computed two chunks, then dropped; `dead` never computed
    assert sched.dropped_expired == 2 and sched.tokens_computed == 16 + 24
    assert torch.allclose(logits, eng.rank_encode([request(eng, 2, 24)])[0], atol=TOL, rtol=0)


async def test_a_failing_member_fails_only_its_own_request(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    sched = ComputeScheduler(eng, max_batch=8)
    good = [request(eng, s, 20) for s in (1, 2)]
    bad = request(eng, 3, 20)
    bad.long_items[4] = 10_000  # beyond the catalogue: the embedding lookup raises
    futs = [sched.submit_prefill(good[0].long_items, good[0].long_ts),
            sched.submit_prefill(bad.long_items, bad.long_ts),
            sched.submit_prefill(good[1].long_items, good[1].long_ts)]
    await asyncio.sleep(0)
    sched.start()
    done = await asyncio.gather(*futs, return_exceptions=True)
    await sched.stop()
    assert isinstance(done[1], Exception)
    for (kv, _), r in zip((done[0], done[2]), good, strict=True):
        assert torch.allclose(kv.values[0], eng.prefill(r.long_items, r.long_ts).values[0], atol=TOL, rtol=0)
    assert sched.depth() == {"hits": 0, "misses": 0, "prefills": 0}

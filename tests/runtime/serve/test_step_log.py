"""The compute loop logs every step it runs, with its sizes, in a bounded ring; a cost profile fitted to the log of
a stand-in backend that charges known virtual costs recovers them (residuals ~0), and a noisy one's residual
quantiles show its spread."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from grstack.runtime.serve.clock import ManualClock
from grstack.runtime.serve.cost_profile import STEP_FEATURES, fit_steps
from grstack.runtime.serve.engine import PrefixKV, RankItem, RelayEngine
from grstack.runtime.serve.scheduler import ComputeScheduler, ThreadRunner
from grstack.runtime.serve.step_log import Ring, StepLog, attention_pairs

pytestmark = pytest.mark.unit

TRUE = {"rank_cached": (2e-3, 3e-4, 4e-5, 6e-6, 1e-7),  # seconds per step, user, token, context token, pair
        "rank_full": (5e-3, 1e-3, 2e-5, 0.0, 3e-7),
        "extend_many": (1e-3, 5e-4, 8e-5, 2e-6, 4e-7)}


def test_ring_keeps_the_last_records_and_counts_what_a_slow_reader_missed() -> None:
    ring: Ring[int] = Ring(3)
    for i in range(1, 6):
        ring.append(i * 10)
    assert len(ring) == 3 and ring.appended == 5
    assert ring.since(0) == ([30, 40, 50], 2)  # records 1 and 2 were overwritten
    assert ring.since(3) == ([40, 50], 0)
    assert ring.since(5) == ([], 0)
    with pytest.raises(ValueError):
        Ring(0)


def test_attention_pairs_count_context_and_causal_new_tokens() -> None:
    assert attention_pairs([1], [0]) == 1
    assert attention_pairs([4], [10]) == 4 * 10 + 10
    assert attention_pairs([2, 3], [5, 0]) == (10 + 3) + (0 + 6)


class ChargedBackend:
    """The engine's results, each call charged ``coef · (1, batch, tokens, context, pairs)`` of virtual time
    (times a lognormal factor when ``noise``), computed from the call's own arguments; ``calls`` records them."""

    def __init__(self, eng: RelayEngine, clock: ManualClock, noise: float = 0.0, seed: int = 0) -> None:
        self.eng, self.clock, self.noise = eng, clock, noise
        self.rng = np.random.default_rng(seed)
        self.chunk = eng.chunk
        self.empty_prefix, self.prefix_tokens, self.item_tokens = eng.empty_prefix, eng.prefix_tokens, eng.item_tokens
        self.extend, self.prefill_tokens, self.rank_encode = eng.extend, eng.prefill_tokens, eng.rank_encode
        self.calls: list[tuple[str, int, int, int, int]] = []

    def _charge(self, kind: str, new: list[int], context: list[int]) -> None:
        sizes = (1, len(new), sum(new), sum(context), attention_pairs(new, context))
        seconds = sum(c * x for c, x in zip(TRUE[kind], sizes, strict=True))
        if self.noise:
            seconds *= float(self.rng.lognormal(0.0, self.noise))
        self.calls.append((kind, *sizes[1:]))
        self.clock.t += seconds  # on the compute thread; nothing sleeps on the clock meanwhile

    def extend_many(self, prefixes: list[PrefixKV], items: list[np.ndarray], *args: Any) -> list[PrefixKV]:
        out = self.eng.extend_many(prefixes, items, *args)
        self._charge("extend_many", [len(i) for i in items], [p.length for p in prefixes])
        return out

    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        out = self.eng.rank_cached(prefixes, reqs)
        self._charge("rank_cached", [len(r.short_items) + len(r.candidates) for r in reqs],
                     [p.length for p in prefixes])
        return out

    def rank_full(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        out = self.eng.rank_full(reqs)
        self._charge("rank_full", [len(self.eng.item_tokens(r)) + len(r.short_items) + len(r.candidates)
                                   for r in reqs], [0] * len(reqs))
        return out


def item(eng: RelayEngine, rng: np.random.Generator, n_long: int, n_short: int, n_cands: int) -> RankItem:
    n = n_long + n_short
    items = rng.integers(1, 300, n)
    ts = 1_600_000_000 + np.cumsum(rng.integers(1, 999, n))
    return eng.canonical(items[:n_long], ts[:n_long], items[n_long:], ts[n_long:],
                         rng.integers(1, 300, n_cands), int(ts[-1]))


async def serve_mixed_load(backend: ChargedBackend, eng: RelayEngine, clock: ManualClock,
                           seed: int = 0) -> ComputeScheduler:
    """Waves of prefills, cached ranks, short and long misses, of varying sizes and batch sizes."""
    rng = np.random.default_rng(seed)
    sched = ComputeScheduler(backend, max_batch=4, clock=clock, max_step_tokens=None, steps=StepLog(4096))
    sched.start()
    for wave in range(12):
        k = 1 + wave % 4
        reqs = [item(eng, rng, int(rng.integers(9, 40)), int(rng.integers(0, 5)), int(rng.integers(1, 7)))
                for _ in range(k)]
        kvs = [kv for kv, _ in await asyncio.gather(*(sched.prefill(r.long_items, r.long_ts) for r in reqs))]
        await asyncio.gather(*(sched.rank_cached(kv, r) for kv, r in zip(kvs, reqs, strict=True)))
        short = [item(eng, rng, int(rng.integers(1, 8)), int(rng.integers(0, 5)), int(rng.integers(1, 7)))
                 for _ in range(k)]
        await asyncio.gather(*(sched.rank_full(r) for r in short))
        await asyncio.gather(*(sched.rank_full(item(eng, rng, int(rng.integers(9, 40)), 2, 3)) for _ in range(k)))
    await sched.stop()
    return sched


def logged(sched: ComputeScheduler) -> list[dict[str, Any]]:
    steps, dropped = sched.steps.steps.since(0)
    assert dropped == 0
    return [{"kind": s.kind, "batch": s.batch, "tokens": s.tokens, "context": s.context, "pairs": s.pairs,
             "seconds": s.seconds, "t": s.t} for s in steps]


async def test_the_step_log_records_what_ran_and_a_fit_recovers_the_charged_costs(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock()
    backend = ChargedBackend(eng, clock)
    steps = logged(await serve_mixed_load(backend, eng, clock))
    assert [(s["kind"], s["batch"], s["tokens"], s["context"], s["pairs"]) for s in steps] == backend.calls
    assert {s["kind"] for s in steps} == set(TRUE) and max(s["batch"] for s in steps) == 4
    for s in steps:  # the seconds logged are those the call charged on the scheduler's clock
        sizes = dict(zip(STEP_FEATURES[1:5], (s["batch"], s["tokens"], s["context"], s["pairs"]), strict=True))
        assert s["seconds"] == pytest.approx(sum(c * x for c, x in zip(TRUE[s["kind"]], (1, *sizes.values()),
                                                                      strict=True)), rel=1e-9)
    assert all(b["t"] >= a["t"] + a["seconds"] - 1e-12 for a, b in itertools.pairwise(steps))
    models = fit_steps(steps)
    for kind, true in TRUE.items():
        m = models[kind]
        assert m.samples == sum(s["kind"] == kind for s in steps)
        assert max(abs(m.residual(u)) for u in (0.0, 0.5, 0.99, 1.0)) < 1e-6
        probe = {"batch": 3, "tokens": 120, "context": 0 if kind == "rank_full" else 90, "pairs": 4000}
        want = sum(c * probe.get(f, 1) for c, f in zip(true, STEP_FEATURES[:5], strict=True))
        assert m.predict(probe) == pytest.approx(want, rel=1e-4)  # sizes it never saw
    assert models["rank_cached"].coef == pytest.approx((*TRUE["rank_cached"], 0.0), rel=1e-4, abs=1e-12)


async def test_a_noisy_backend_leaves_its_spread_in_the_residual_quantiles(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock()
    steps = logged(await serve_mixed_load(ChargedBackend(eng, clock, noise=0.3, seed=1), eng, clock))
    m = fit_steps(steps)["rank_cached"]
    tails = m.tails()
    assert abs(tails["p50"]) < 0.2  # the fit is centred on the typical step
    assert 0.1 < tails["p90"] < tails["p99"] <= tails["max"]
    assert m.residual(0.0) < -0.1
    draws = [m.draw(u, {"batch": 2, "tokens": 20, "context": 60, "pairs": 900}) for u in np.linspace(0, 1, 11)]
    assert draws == sorted(draws) and draws[0] < draws[-1]  # inverse CDF: a simulator's draws keep the tails


async def test_each_step_logs_its_compute_threads_cpu_beside_its_seconds(kit: SimpleNamespace) -> None:
    """The CPU clock is the runner's: here one that runs at half the scheduler's clock, as a compute thread given
    half of a shared core would; a simulated replica's runner has none (None logged)."""
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock()
    backend = ChargedBackend(eng, clock)
    sched = ComputeScheduler(backend, max_batch=4, clock=clock, steps=StepLog(64),
                             runner=ThreadRunner(cpu_clock=lambda: 0.5 * clock()))
    sched.start()
    rng = np.random.default_rng(3)
    reqs = [item(eng, rng, 20, 2, 3) for _ in range(3)]
    kvs = [kv for kv, _ in await asyncio.gather(*(sched.prefill(r.long_items, r.long_ts) for r in reqs))]
    await asyncio.gather(*(sched.rank_cached(kv, r) for kv, r in zip(kvs, reqs, strict=True)))
    await sched.rank_full(item(eng, rng, 3, 1, 2))
    await sched.stop()
    steps, _ = sched.steps.steps.since(0)
    assert {s.kind for s in steps} == set(TRUE)
    for s in steps:
        assert s.cpu_seconds == pytest.approx(0.5 * s.seconds, rel=1e-9, abs=1e-15)


async def test_the_default_runner_reads_the_threads_cpu_time(kit: SimpleNamespace) -> None:
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    sched = ComputeScheduler(eng, max_batch=2, steps=StepLog(16))
    sched.start()
    r = item(eng, np.random.default_rng(4), 30, 2, 3)
    await sched.rank_full(r)
    await sched.stop()
    steps = sched.steps.steps.since(0)[0]
    assert steps and sum(s.cpu_seconds or 0.0 for s in steps) > 0.0
    for s in steps:  # one thread's CPU cannot outrun the wall clock
        assert s.cpu_seconds is not None and 0.0 <= s.cpu_seconds <= s.seconds + 1e-3


async def test_a_hits_ranking_is_logged_cold_and_a_chunk_steps_warm(kit: SimpleNamespace) -> None:
    """``cold``: a cached ranking of a hit reads all its context from the cache; the ranking inside a chunk step
    reads the prefix that step just computed (0); extends and full inferences log 0."""
    eng = RelayEngine(kit.make_model(), max_suffix=8, chunk=8)
    clock = ManualClock()
    sched = await serve_mixed_load(ChargedBackend(eng, clock), eng, clock)
    steps = sched.steps.steps.since(0)[0]
    ranked = [(a, b) for a, b in itertools.pairwise(steps) if b.kind == "rank_cached"]
    warm = [(a, b) for a, b in ranked if b.cold == 0]
    cold = [b for _, b in ranked if b.cold > 0]
    assert warm and cold  # long misses' chunk steps rank warm; the waves' hits rank cold
    assert all(a.kind == "extend_many" and b.t == pytest.approx(a.t + a.seconds) for a, b in warm)
    assert all(b.cold == b.context for b in cold)
    assert all(s.cold == 0 for s in steps if s.kind != "rank_cached")

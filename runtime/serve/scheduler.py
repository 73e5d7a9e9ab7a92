"""The ranker's compute loop: one compute thread, concurrent requests batched, prefills interleaved.

Work is done in steps on a single executor thread (torch releases the GIL, so the event loop keeps
accepting requests meanwhile). Each step is one of, in priority order:

1. a batch of **cached ranks** — every queued request whose prefix K/V is at hand, up to ``max_batch``;
2. a step of the **rank misses** (and prefills a rank joined): queued unstarted misses with short
   histories are ranked together by full inference; otherwise up to ``max_step_tokens`` new tokens of up
   to ``max_batch`` queued misses, given out first come first served (:func:`step_shares`), are computed
   in one model call jagged over the users, and those whose prefix is then complete are ranked in one
   cached-prefix call;
3. a step of the **prefills**, in one model call likewise.

A prefill or miss may start from a **base**: a cached older version of the user's prefix that is a prefix of
the new one (incremental prefill); only the tokens after it are computed. Ranks are latency-critical and
prefills are not, but a prefill must not starve: after ``prefill_every`` consecutive rank steps with
prefills waiting, one prefill step runs. ``max_step_tokens`` (a bound on the new tokens of one step; without
it each job advances by one ``chunk``) keeps any rank from waiting behind more than one step of long prefills.

With a KV arena (``reserve``), a prefill or miss reserves its whole prefix's range when queued (the base copied
into it once) and its chunks are written in place; a queued rank pins the range of its prefix, so eviction
can neither move nor reuse it before the rank has read it.

Overload: the rank queues (hits and misses together) hold at most ``max_queue`` requests and the prefill
queue ``max_prefill_queue``; beyond that a submission raises :class:`QueueFull` at once (the ranker answers
503 with ``Retry-After``), nothing already queued is touched. A rank may carry a deadline (scheduler
clock): a request whose deadline has passed is dropped before any of its compute runs (and a miss
between its chunks) with :class:`DeadlineExceeded`. A rank that needs a prefix being prefilled joins that
prefill: :meth:`boost` moves the prefill into the rank queue, ahead of the remaining prefills. When one
member of a batched step fails, the members are retried one by one so that only the failing one's request
fails.

Accounting (read by ``GET /v1/stats``): prefix tokens computed, tokens a from-scratch prefill would have
computed for the same work, incremental prefills, and compute-thread time by kind (``prefill``,
``rank_cached``, ``rank_full``; a batched chunk step's time is split over its members by tokens). Every call of
the tensor math is also logged, with its sizes, in a bounded ring (``steps``, :class:`StepLog`; read by
``GET /v1/steps``), which is what a cost profile is fitted to.

This module is the executor loop and the public API; admission (queue bounds, deadline prediction and the step
cost models) is :class:`AdmissionPolicy` (scheduler_admission.py), the jobs and queues scheduler_jobs.py, the
tensor math a :class:`ComputeBackend` and time the injected clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from grstack.runtime.serve.backend import ComputeBackend
from grstack.runtime.serve.clock import Now, SystemClock, thread_cpu
from grstack.runtime.serve.engine import PrefixKV, PrefixTokens, RankItem
from grstack.runtime.serve.scheduler_admission import AdmissionPolicy, PredictedLate, QueueFull, StepCost
from grstack.runtime.serve.scheduler_jobs import Hit, Job, Timing, WorkQueues, step_shares
from grstack.runtime.serve.step_log import StepLog

__all__ = ["COMPUTE_KINDS", "ComputeScheduler", "DeadlineExceeded", "PredictedLate", "QueueFull", "StepCost",
           "Timing", "step_shares"]

COMPUTE_KINDS = ("prefill", "rank_cached", "rank_full")


class DeadlineExceeded(Exception):
    """The request's deadline passed before its compute ran; it was dropped, not computed."""


class ComputeRunner(Protocol):
    """Runs one call of the tensor math off the event loop and returns its result. ``cpu_clock``: the CPU seconds
    of the thread that runs it (a step's CPU, beside its seconds on the clock), or None where no thread does."""

    cpu_clock: Now | None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    def close(self) -> None: ...


class ThreadRunner:
    """The ranker's one compute thread (torch releases the GIL: the event loop keeps serving meanwhile)."""

    def __init__(self, cpu_clock: Now | None = thread_cpu) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranker-compute")
        self.cpu_clock = cpu_clock

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass
class ComputeScheduler:
    engine: ComputeBackend  # the tensor math: the real engine, or a stand-in for it
    max_batch: int = 32
    prefill_every: int = 4
    on_batch: Callable[[int], None] | None = None
    clock: Now = field(default_factory=SystemClock)  # deadlines, queue times and compute seconds
    max_queue: int | None = None  # queued ranks (hits + misses); None: unbounded
    max_prefill_queue: int | None = None  # queued prefills; None: unbounded
    retry_after_s: float = 1.0
    max_step_tokens: int | None = None  # new tokens of one batched chunk step (at least one job); None: no bound
    on_tokens: Callable[[int, int], None] | None = None  # (computed, without incremental) per step
    on_compute: Callable[[str, float], None] | None = None  # (kind, seconds) per step
    # (tokens, base, evict) -> an arena range of ``tokens`` holding ``base``'s K/V (None: none could be had);
    # with it a prefill or miss writes its chunks in place instead of concatenating (RankerConfig.kv_arena).
    # ``evict``: cached entries may be evicted for it (not for a miss without a base: its result is not cached)
    reserve: Callable[..., PrefixKV | None] | None = None
    # None: no prediction. Else a rank predicted to finish later than its deadline minus this is refused at
    # admission (:class:`PredictedLate`); the margin is the answer's way back to the caller
    admission_margin_s: float | None = None
    steps: StepLog = field(default_factory=StepLog)  # every step run, with its sizes and seconds (bounded)
    # where the tensor math runs: one compute thread (None), or a stand-in holding a simulated replica's core on
    # virtual time (runtime/serve/virtual_time.py)
    runner: ComputeRunner = field(default_factory=ThreadRunner)

    def __post_init__(self) -> None:
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dropped_expired = 0
        self.tokens_computed = 0
        self.tokens_without_incremental = 0
        self.incremental_prefills = 0
        self.compute_s: dict[str, float] = dict.fromkeys(COMPUTE_KINDS, 0.0)
        self.queues = WorkQueues()
        self.admission = AdmissionPolicy(self.queues, self.clock, self.engine.chunk, self.max_batch,
                                         self.prefill_every, self.max_step_tokens, self.max_queue,
                                         self.max_prefill_queue, self.retry_after_s, self.admission_margin_s)

    # the step cost models the admission policy predicts with and this loop feeds
    @property
    def hit_cost(self) -> StepCost:
        return self.admission.hit_cost

    @hit_cost.setter
    def hit_cost(self, cost: StepCost) -> None:
        self.admission.hit_cost = cost

    @property
    def token_cost(self) -> StepCost:
        return self.admission.token_cost

    @token_cost.setter
    def token_cost(self, cost: StepCost) -> None:
        self.admission.token_cost = cost

    @property
    def full_cost(self) -> StepCost:
        return self.admission.full_cost

    @full_cost.setter
    def full_cost(self, cost: StepCost) -> None:
        self.admission.full_cost = cost

    # -- public API (event loop) --------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.runner.close()

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn`` on the compute thread (profiling, warm-up) outside the queues."""
        return await self.runner.run(fn, *args)

    def depth(self) -> dict[str, int]:
        return self.queues.depth()

    def backlog_tokens(self) -> int:
        """Prefix tokens still to compute for the queued misses and prefills."""
        return self.queues.backlog_tokens()

    def check_join(self, fut: asyncio.Future[Any], deadline: float | None) -> None:
        """Raises :class:`PredictedLate` when a rank joining the prefill behind ``fut`` would be late
        (:meth:`AdmissionPolicy.check_join`); call it before :meth:`boost`."""
        self.admission.check_join(fut, deadline)

    def _cpu(self) -> float | None:
        cpu = self.runner.cpu_clock
        return cpu() if cpu is not None else None

    def _timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float, float | None]:
        """Compute thread: ``fn(*args)``, when it started, its seconds on the clock (the thread hop excluded:
        what the math costs, which is what the step log records) and the thread's CPU seconds in it (None
        without a CPU clock). The two differ by the time the core gave to other threads meanwhile."""
        c0 = self._cpu()
        t0 = self.clock()
        out = fn(*args)
        seconds = self.clock() - t0
        c1 = self._cpu()
        return out, t0, seconds, (c1 - c0 if c0 is not None and c1 is not None else None)

    @staticmethod
    def _suffix(item: RankItem) -> int:
        """Tokens a rank computes after its prefix: its short-term events and its candidates."""
        return len(item.short_items) + len(item.candidates)

    def _expired(self, deadline: float | None, now: float | None = None) -> bool:
        return deadline is not None and (self.clock() if now is None else now) >= deadline

    def _drop(self, fut: asyncio.Future[Any]) -> None:
        self.dropped_expired += 1
        if not fut.done():
            fut.set_exception(DeadlineExceeded("deadline passed while queued; dropped before compute"))

    def _job(self, prefix: PrefixTokens, base: PrefixKV | None, item: RankItem | None = None,
             deadline: float | None = None, keep: bool = False) -> Job:
        if base is not None and not base.live:  # its arena range was freed: compute from scratch
            base = None
        kv = base if base is not None else self.engine.empty_prefix()
        n = len(prefix)
        if kv.length > n:
            raise ValueError(f"the base prefix ({kv.length} tokens) is longer than the prefix ({n})")
        fut = asyncio.get_running_loop().create_future()
        job = Job(fut, self.clock(), prefix, kv, kv.length, item, deadline)
        short = item is not None and base is None and n <= self.engine.chunk  # ranked by full inference
        room = None
        if self.reserve is not None and not short and n:
            room = self.reserve(n, base, evict=item is None or base is not None or keep)
        if room is not None:
            job.kv, job.reserved = room, True
        if job.kv.pin():
            job.pinned.append(job.kv)
        return job

    def _end(self, job: Job, *, keep: bool) -> None:
        """The job is off the queues: unpin what it read; its reserved range goes with the result when
        ``keep`` (the caller caches or releases it), else it is released now."""
        for kv in job.pinned:
            kv.unpin()
        job.pinned.clear()
        if job.reserved and not keep:
            job.kv.release()
        job.reserved = False

    async def rank_cached(self, kv: PrefixKV, item: RankItem,
                          deadline: float | None = None) -> tuple[torch.Tensor, Timing]:
        self.admission.admit_rank()
        self.admission.admit_hit(deadline)
        if not kv.pin():
            raise ValueError("the cached prefix was evicted and its arena range freed before the rank was queued")
        fut = asyncio.get_running_loop().create_future()
        self.queues.hits.append(Hit(kv, item, fut, self.clock(), deadline))
        self._wake.set()
        return await fut

    async def rank_full(self, item: RankItem, deadline: float | None = None) -> tuple[torch.Tensor, Timing]:
        """Ranks a cache miss: its whole prefix is computed on the critical path."""
        (logits, kv), timing = await self._submit_miss(item, None, deadline)
        if kv is not None:  # not cached: a reserved arena range is given back
            kv.release()
        return logits, timing

    async def rank_full_cached(self, item: RankItem,
                               deadline: float | None = None) -> tuple[torch.Tensor, PrefixKV | None, Timing]:
        """Ranks a cache miss and returns its whole prefix's K/V for the cache (automatic prefix caching), or
        None when the miss fit one chunk and was ranked by one full inference, which keeps no K/V."""
        (logits, kv), timing = await self._submit_miss(item, None, deadline, keep=True)
        return logits, kv, timing

    async def rank_extend(self, item: RankItem, base: PrefixKV,
                          deadline: float | None = None) -> tuple[torch.Tensor, PrefixKV | None, Timing]:
        """Ranks a miss whose cached older prefix ``base`` is a prefix of ``item``'s: only the tokens after
        it are computed. Returns the logits and the whole new prefix's K/V (for the cache); None when
        ``base``'s arena range was freed meanwhile and the miss, short enough, was ranked by one full
        inference (as :meth:`rank_full_cached`)."""
        (logits, kv), timing = await self._submit_miss(item, base, deadline)
        return logits, kv, timing

    async def _submit_miss(self, item: RankItem, base: PrefixKV | None, deadline: float | None,
                           keep: bool = False) -> tuple[tuple[torch.Tensor, PrefixKV | None], Timing]:
        self.admission.admit_rank()
        prefix = self.engine.item_tokens(item)
        if self.admission_margin_s is not None and deadline is not None:
            kv = base if base is not None and base.live else self.engine.empty_prefix()
            probe = Job(asyncio.get_running_loop().create_future(), 0.0, prefix, kv, kv.length, item)
            self.admission.admit_miss(deadline, self.admission.job_s(probe))
        job = self._job(prefix, base, item, deadline, keep)
        self.queues.misses.append(job)
        self._wake.set()
        return await job.future

    def submit_prefill(self, items: Any, ts: Any, base: PrefixKV | None = None,
                       prefix: PrefixTokens | None = None) -> asyncio.Future[tuple[PrefixKV, Timing]]:
        """Queues a prefill of the prefix ``items``/``ts`` (or of the token stream ``prefix``, for a model
        that reads actions or user context: :meth:`RelayEngine.prefix_tokens`), continuing ``base`` (the K/V
        of its first ``base.length`` tokens) when given, and returns its future (a handle for :meth:`boost`)."""
        self.admission.admit_prefill()
        if prefix is None:
            prefix = self.engine.prefix_tokens(np.asarray(items, dtype=np.int64), np.asarray(ts, dtype=np.int64))
        job = self._job(prefix, base)
        self.queues.prefills.append(job)
        self._wake.set()
        return job.future

    async def prefill(self, items: Any, ts: Any, base: PrefixKV | None = None,
                      prefix: PrefixTokens | None = None) -> tuple[PrefixKV, Timing]:
        return await self.submit_prefill(items, ts, base, prefix)

    def boost(self, fut: asyncio.Future[Any]) -> bool:
        """A rank waits on this prefill: it moves from the prefill queue to the rank queue (behind the
        misses already there, ahead of every other prefill). False if it is not queued as a prefill."""
        if not self.queues.boost(fut):
            return False
        self._wake.set()
        return True

    # -- the loop -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self.queues.hits or self.queues.misses or self.queues.prefills):
                self._wake.clear()
                await self._wake.wait()
                continue
            starve = self.queues.prefills and self.queues.critical_streak >= self.prefill_every
            if self.queues.hits and not starve:
                await self._step_hits(loop)
                self.queues.critical_streak += 1
            elif self.queues.misses and not starve:
                await self._step_misses(loop)
                self.queues.critical_streak += 1
            else:
                self.queues.critical_streak = 0
                await self._step_chunks(loop, self.queues.prefills)

    def _account(self, kind: str, seconds: float) -> None:
        self.compute_s[kind] += seconds
        if self.on_compute is not None:
            self.on_compute(kind, seconds)

    def _count_tokens(self, computed: int, without: int) -> None:
        self.tokens_computed += computed
        self.tokens_without_incremental += without
        if self.on_tokens is not None:
            self.on_tokens(computed, without)

    async def _step_hits(self, loop: asyncio.AbstractEventLoop) -> None:
        popped = [self.queues.hits.popleft() for _ in range(min(self.max_batch, len(self.queues.hits)))]
        try:
            await self._rank_hits(loop, popped)
        finally:
            for h in popped:
                h.kv.unpin()

    async def _rank_hits(self, loop: asyncio.AbstractEventLoop, popped: list[Hit]) -> None:
        batch = [h for h in popped if not h.future.cancelled()]
        now = self.clock()
        for h in [h for h in batch if self._expired(h.deadline, now)]:
            self._drop(h.future)
        batch = [h for h in batch if not self._expired(h.deadline, now)]
        if not batch:
            return
        start = self.clock()
        if self.on_batch is not None:
            self.on_batch(len(batch))
        t0 = self.clock()
        self._expect(self.hit_cost.predict(len(batch)))
        try:
            out, began, seconds, cpu_s = await self.runner.run(self._timed, self.engine.rank_cached,
                                                               [h.kv for h in batch], [h.item for h in batch])
        except Exception as exc:
            for h in batch:
                if not h.future.done():
                    h.future.set_exception(exc)
            return
        finally:
            self.queues.running_until = None
            self._account("rank_cached", self.clock() - t0)
        self.hit_cost.add(len(batch), self.clock() - t0)
        self.steps.step(began, "rank_cached", [self._suffix(h.item) for h in batch], [h.kv.length for h in batch],
                        seconds, cpu_s, cold=True)
        end = self.clock()
        for h, logits in zip(batch, out, strict=True):
            if not h.future.done():
                h.future.set_result((logits, Timing((start - h.enqueued) * 1e3, (end - start) * 1e3)))

    async def _step_misses(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.queues.misses[0].short(self.engine.chunk):
            await self._step_chunks(loop, self.queues.misses)
            return
        # Unstarted short misses are ranked together: one batched full inference, of at most max_step_tokens
        # tokens (at least one miss), first come first served.
        batch: list[Job] = []
        now, used = self.clock(), 0
        misses = self.queues.misses
        while misses and len(batch) < self.max_batch and misses[0].short(self.engine.chunk):
            if batch and self.max_step_tokens is not None and used + misses[0].tokens > self.max_step_tokens:
                break
            job = misses.popleft()
            self._end(job, keep=False)  # full inference: nothing read from or written to a reserved range
            if self._expired(job.deadline, now):
                self._drop(job.future)
            elif not job.future.cancelled():
                batch.append(job)
                used += job.tokens
        if not batch:
            return
        start = self.clock()
        if self.on_batch is not None:
            self.on_batch(len(batch))
        t0 = self.clock()
        tokens = sum(j.tokens for j in batch)
        self._expect(self.full_cost.predict(tokens))
        try:
            items = [item for j in batch if (item := j.item) is not None]  # short misses: all rank requests
            out, began, seconds, cpu_s = await self.runner.run(self._timed, self.engine.rank_full, items)
        except Exception as exc:
            for j in batch:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        finally:
            self.queues.running_until = None
            self._account("rank_full", self.clock() - t0)
        self.full_cost.add(tokens, self.clock() - t0)
        self.steps.step(began, "rank_full", [j.tokens + self._suffix(i) for j, i in zip(batch, items, strict=True)],
                        [0] * len(batch), seconds, cpu_s)
        self._count_tokens(tokens, tokens)
        end = self.clock()
        for j, logits in zip(batch, out, strict=True):
            if not j.future.done():
                j.future.set_result(((logits, None), Timing((start - j.enqueued) * 1e3, (end - start) * 1e3)))

    def _collect(self, queue: deque[Job]) -> list[tuple[Job, int]]:
        """The next chunk step: jobs from the head of ``queue`` with the new tokens each computes
        (:func:`step_shares`); cancelled and expired jobs met on the way are dropped first."""
        now, i = self.clock(), 0
        while i < len(queue):
            job = queue[i]
            if job.future.done():
                del queue[i]
                self._end(job, keep=False)
            elif self._expired(job.deadline, now):  # before its first chunk, or between chunks
                del queue[i]
                self._end(job, keep=False)
                self._drop(job.future)
            else:
                i += 1
        jobs = list(queue)[:self.max_batch]
        return list(zip(jobs, self.admission.shares([j.remaining for j in jobs]), strict=False))

    def _compute_chunks(self, plan: list[tuple[Job, int]]) -> tuple[list[PrefixKV], list[torch.Tensor | None],
                                                                      float, float, float, tuple[float | None, ...]]:
        """Compute thread: each job's next ``n`` tokens, all in one call, then one cached-prefix ranking of the
        misses whose prefix is complete. Returns the new prefixes, logits, when it started, the two parts'
        seconds and their CPU seconds (Nones without a CPU clock)."""
        c0 = self._cpu()
        t0 = self.clock()
        jobs = [j for j, _ in plan]
        chunks = [j.next_chunk(n) for j, n in plan]
        kvs = self.engine.extend_many([j.kv for j in jobs], [c.items for c in chunks], [c.ts for c in chunks],
                                      [c.actions for c in chunks], [c.context for c in chunks])
        t1 = self.clock()
        c1 = self._cpu()
        done = [b for b, j in enumerate(jobs) if j.item is not None and kvs[b].length == j.tokens]
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        if done:
            out = self.engine.rank_cached([kvs[b] for b in done], [jobs[b].item for b in done])  # type: ignore[misc]
            for b, lg in zip(done, out, strict=True):
                logits[b] = lg
        t2 = self.clock()
        c2 = self._cpu()
        cpu = (c1 - c0, c2 - c1) if c0 is not None and c1 is not None and c2 is not None else (None, None)
        return kvs, logits, t0, t1 - t0, t2 - t1, cpu

    async def _step_chunks(self, loop: asyncio.AbstractEventLoop, queue: deque[Job]) -> None:
        plan = self._collect(queue)
        if not plan:
            return
        batch = [j for j, _ in plan]
        start = self.clock()
        first = [j.started is None for j in batch]
        for j in batch:
            j.started = start if j.started is None else j.started
        if self.on_batch is not None:
            self.on_batch(len(batch))
        ranked = sum(1 for j, n in plan if j.item is not None and j.remaining <= n)
        self._expect(self.token_cost.predict(sum(n for _, n in plan))
                     + (self.hit_cost.predict(ranked) if ranked else 0.0))
        try:
            groups = [(batch, first, await self.runner.run(self._compute_chunks, plan))]
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            groups = []  # isolate the failing member: the others are computed one by one
            for (j, n), f in zip(plan, first, strict=True):
                try:
                    groups.append(([j], [f], await self.runner.run(self._compute_chunks,
                                                                         [(j, n)])))
                except Exception as one:
                    self._fail(j, one)
        finally:
            self.queues.running_until = None
        for jobs, firsts, (kvs, logits, began, extend_s, rank_s, cpu) in groups:
            self._log_chunks(jobs, kvs, logits, began, extend_s, rank_s, cpu)
            self._apply(jobs, firsts, kvs, logits, extend_s, rank_s)

    def _log_chunks(self, jobs: list[Job], kvs: list[PrefixKV], logits: list[torch.Tensor | None], began: float,
                    extend_s: float, rank_s: float, cpu: tuple[float | None, ...] = (None, None)) -> None:
        """A chunk step's two calls in the step log (before :meth:`_apply` moves each job to its new K/V)."""
        self.steps.step(began, "extend_many", [kv.length - j.kv.length for j, kv in zip(jobs, kvs, strict=True)],
                        [j.kv.length for j in jobs], extend_s, cpu[0])
        ranked = [(item, kv) for j, kv, lg in zip(jobs, kvs, logits, strict=True)
                  if lg is not None and (item := j.item) is not None]
        if ranked:
            self.steps.step(began + extend_s, "rank_cached", [self._suffix(item) for item, _ in ranked],
                            [kv.length for _, kv in ranked], rank_s, cpu[1])

    def _expect(self, seconds: float) -> None:
        self.queues.running_until = self.clock() + seconds

    def _apply(self, jobs: list[Job], first: list[bool], kvs: list[PrefixKV], logits: list[torch.Tensor | None],
               extend_s: float, rank_s: float) -> None:
        new = [kv.length - j.kv.length for j, kv in zip(jobs, kvs, strict=True)]
        total = sum(new) or 1
        self.token_cost.add(sum(new), extend_s)
        ranked = sum(1 for lg in logits if lg is not None)
        if ranked:
            self.hit_cost.add(ranked, rank_s)
        prefill_share = sum(n for j, n in zip(jobs, new, strict=True) if j.item is None) / total
        self._account("prefill", extend_s * prefill_share)
        self._account("rank_full", extend_s * (1 - prefill_share) + rank_s)
        skipped = sum(j.base_len for j, f in zip(jobs, first, strict=True) if f)
        self.incremental_prefills += sum(1 for j, f in zip(jobs, first, strict=True) if f and j.base_len)
        self._count_tokens(sum(new), sum(new) + skipped)
        end = self.clock()
        for j, kv, lg in zip(jobs, kvs, logits, strict=True):
            j.kv = kv
            if j.remaining:
                continue
            self.queues.remove(j)
            value = kv if j.item is None else (lg, kv)
            self._end(j, keep=not j.future.done())
            if not j.future.done():
                assert j.started is not None  # _step_chunks set it before the job's first step
                j.future.set_result((value, Timing((j.started - j.enqueued) * 1e3, (end - j.started) * 1e3)))

    def _fail(self, job: Job, exc: Exception) -> None:
        self.queues.remove(job)
        self._end(job, keep=False)
        if not job.future.done():
            job.future.set_exception(exc)

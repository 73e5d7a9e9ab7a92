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
``rank_cached``, ``rank_full``; a batched chunk step's time is split over its members by tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from grstack.runtime.serve.engine import PrefixKV, PrefixTokens, RankItem, RelayEngine

COMPUTE_KINDS = ("prefill", "rank_cached", "rank_full")


def step_shares(remaining: list[int], *, max_jobs: int, chunk: int, budget: int | None) -> list[int]:
    """New tokens each queued job computes in the next step, for the jobs at the head of the queue (in queue
    order; the list is as long as the jobs the step takes). With a ``budget`` (tokens per step) it is filled
    first come, first served: the head job computes all it has left if that fits, the next ones what remains
    of the budget, as vLLM's chunked prefill fills its token budget. A burst of equal jobs then finishes one
    step's worth at a time instead of all together at the end (processor sharing, which makes every member of
    a burst as late as its last), and the step, so a cached rank's wait behind it, stays bounded. Without a
    budget every job advances by one ``chunk``."""
    shares: list[int] = []
    used = 0
    for left in remaining:
        if len(shares) >= max_jobs:
            break
        if budget is None:
            shares.append(min(chunk, left))
            continue
        room = budget - used
        if room <= 0:
            break
        n = min(left, room)
        shares.append(n)
        used += n
    return shares


class QueueFull(Exception):
    """The queue for this kind of work is at its bound; retry after ``retry_after_s``. ``reason`` is what the
    ranker's 503 says in ``X-Grstack-Shed``."""

    reason = "queue-full"

    def __init__(self, queue: str, depth: int, retry_after_s: float, message: str | None = None) -> None:
        super().__init__(message or f"{queue} queue full ({depth} waiting)")
        self.queue = queue
        self.depth = depth
        self.retry_after_s = retry_after_s


class PredictedLate(QueueFull):
    """The rank would finish after its deadline behind the work already queued: refused at once (503), so
    that the caller can go elsewhere or give up now instead of learning it at the deadline."""

    reason = "predicted-late"


@dataclass
class StepCost:
    """Seconds of one compute step as ``a + b·n`` (``n``: cached ranks in the batch, or prefix tokens computed),
    fitted by exponentially weighted least squares, so that it follows the speed the ranker has now (CPU
    contention, a warm allocator), fixed per-step overhead included; ``dev`` is the weighted mean absolute
    error of its predictions. It predicts 0 until ``warm`` steps were seen: a ranker admits everything until
    it has measured its own speed."""

    alpha: float = 0.1
    warm: int = 8
    samples: int = 0
    dev: float = 0.0
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weighted Σ1, Σn, Σt, Σn², Σn·t

    def add(self, n: float, seconds: float) -> None:
        if self.samples >= self.warm:
            self.dev += self.alpha * (abs(seconds - self.predict(n)) - self.dev)
        for i, v in enumerate((1.0, n, seconds, n * n, n * seconds)):
            self.sums[i] = self.sums[i] * (1 - self.alpha) + v
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both non-negative: a line through the origin when the sizes seen do not vary enough, a
        constant when the fitted slope is negative."""
        w, sn, st, snn, snt = self.sums
        if w <= 0:
            return 0.0, 0.0
        var = w * snn - sn * sn
        if var > 1e-9 * w * snn:
            b = (w * snt - sn * st) / var
            a = (st - b * sn) / w
            if b < 0:
                return st / w, 0.0
            if a >= 0:
                return a, b
        return (0.0, st / sn) if sn > 0 else (st / w, 0.0)

    def predict(self, n: float) -> float:
        if self.samples < self.warm:
            return 0.0
        a, b = self.coefficients()
        return a + b * n


class DeadlineExceeded(Exception):
    """The request's deadline passed before its compute ran; it was dropped, not computed."""


@dataclass
class Timing:
    queue_ms: float
    compute_ms: float


@dataclass
class _Job:
    """A prefill (``item`` None) or a rank miss: ``prefix`` is the whole prefix's token stream, ``kv`` what is
    computed of it so far (starting from the base, ``base_len`` tokens)."""

    future: asyncio.Future[tuple[Any, Timing]]
    enqueued: float
    prefix: PrefixTokens
    kv: PrefixKV
    base_len: int = 0
    item: RankItem | None = None
    deadline: float | None = None
    started: float | None = None
    reserved: bool = False  # kv is a KV-arena range of the whole prefix, held by this job until it ends
    pinned: list[PrefixKV] = field(default_factory=list)  # prefixes compute reads, pinned until the job ends

    @property
    def tokens(self) -> int:
        return len(self.prefix)

    @property
    def remaining(self) -> int:
        return len(self.prefix) - self.kv.length

    def next_chunk(self, chunk: int) -> PrefixTokens:
        p = self.kv.length
        return self.prefix.slice(p, p + chunk)


@dataclass
class _Hit:
    kv: PrefixKV
    item: RankItem
    future: asyncio.Future[tuple[torch.Tensor, Timing]]
    enqueued: float
    deadline: float | None = None


@dataclass
class ComputeScheduler:
    engine: RelayEngine
    max_batch: int = 32
    prefill_every: int = 4
    on_batch: Callable[[int], None] | None = None
    clock: Callable[[], float] = time.perf_counter
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
    _hits: deque[_Hit] = field(default_factory=deque)
    _misses: deque[_Job] = field(default_factory=deque)
    _prefills: deque[_Job] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranker-compute")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._critical_streak = 0
        self.dropped_expired = 0
        self.tokens_computed = 0
        self.tokens_without_incremental = 0
        self.incremental_prefills = 0
        self.compute_s: dict[str, float] = dict.fromkeys(COMPUTE_KINDS, 0.0)
        self.hit_cost = StepCost()  # a batched cached-prefix rank step, by ranks
        self.token_cost = StepCost()  # a chunk step (prefills, long misses), by new prefix tokens
        self.full_cost = StepCost()  # a batched full inference of short misses, by tokens
        self._running_until: float | None = None  # when the step on the compute thread is expected to end

    # -- public API (event loop) --------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn`` on the compute thread (profiling, warm-up) outside the queues."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def depth(self) -> dict[str, int]:
        return {"hits": len(self._hits), "misses": len(self._misses), "prefills": len(self._prefills)}

    def backlog_tokens(self) -> int:
        """Prefix tokens still to compute for the queued misses and prefills."""
        return sum(j.remaining for j in self._misses) + sum(j.remaining for j in self._prefills)

    def _admit_rank(self) -> None:
        depth = len(self._hits) + len(self._misses)
        if self.max_queue is not None and depth >= self.max_queue:
            raise QueueFull("rank", depth, self.retry_after_s)

    # -- deadline prediction ------------------------------------------------------------------------
    def _hits_s(self, count: int) -> float:
        """Predicted seconds of ``count`` cached ranks, in steps of ``max_batch``."""
        full, rest = divmod(count, self.max_batch)
        return full * self.hit_cost.predict(self.max_batch) + (self.hit_cost.predict(rest) if rest else 0.0)

    def _job_s(self, job: _Job) -> float:
        """Predicted seconds of what is left of a miss or prefill: its steps (of up to ``max_step_tokens``, or
        one chunk each without a bound) and, for a miss computed in steps, the cached-prefix rank after them;
        a short miss is one full inference."""
        if self._short_miss(job):
            return self.full_cost.predict(job.tokens)
        unit = self.max_step_tokens or self.engine.chunk
        full, rest = divmod(job.remaining, unit)
        s = full * self.token_cost.predict(unit) + (self.token_cost.predict(rest) if rest else 0.0)
        return s + (self.hit_cost.predict(1) if job.item is not None else 0.0)

    def _prefill_step_tokens(self) -> int:
        """New tokens of the next prefill step (as :meth:`_collect` would batch them)."""
        return sum(self._shares([j.remaining for j in self._prefills]))

    def _shares(self, remaining: list[int]) -> list[int]:
        return step_shares(remaining, max_jobs=self.max_batch, chunk=self.engine.chunk, budget=self.max_step_tokens)

    def _check_deadline(self, deadline: float, work_s: float, rank_steps: int) -> None:
        """Raises :class:`PredictedLate` when ``work_s`` of queued work (``rank_steps`` steps, the request's own
        included) after the running step, with the prefill steps the starvation guard runs between them and
        the models' error, would end later than ``deadline`` minus the margin."""
        now = self.clock()
        running = 0.0 if self._running_until is None else max(0.0, self._running_until - now)
        prefill_steps = (rank_steps + self._critical_streak) // self.prefill_every if self._prefills else 0
        prefills = prefill_steps * self.token_cost.predict(self._prefill_step_tokens())
        error = max(self.hit_cost.dev, self.token_cost.dev, self.full_cost.dev)
        total = running + work_s + prefills + error
        late = now + total + (self.admission_margin_s or 0.0) - deadline
        if late > 0:
            depth = len(self._hits) + len(self._misses)
            raise PredictedLate("rank", depth, self.retry_after_s,
                                f"predicted to finish {late * 1e3:.0f} ms after its deadline ({total * 1e3:.0f} ms "
                                f"of compute before its answer, {depth} ranks queued)")

    def _admit_hit(self, deadline: float | None) -> None:
        """Cached ranks run before every miss: only the queued hits are ahead of a new one."""
        if self.admission_margin_s is None or deadline is None:
            return
        n = len(self._hits) + 1
        self._check_deadline(deadline, self._hits_s(n), -(-n // self.max_batch))

    def _admit_miss(self, deadline: float | None, job_s: float) -> None:
        if self.admission_margin_s is None or deadline is None:
            return
        ahead = self._hits_s(len(self._hits)) + sum(self._job_s(j) for j in self._misses)
        steps = -(-len(self._hits) // self.max_batch) + len(self._misses) + 1
        self._check_deadline(deadline, ahead + job_s, steps)

    def check_join(self, fut: asyncio.Future[Any], deadline: float | None) -> None:
        """A rank about to join the prefill behind ``fut``: raises :class:`PredictedLate` when that prefill,
        where :meth:`boost` puts it in the rank queue, and the rank after it are predicted to end past
        ``deadline``. Call it before :meth:`boost`, so that a refused rank raises no prefill's priority."""
        if self.admission_margin_s is None or deadline is None:
            return
        ahead, steps = self._hits_s(len(self._hits)), -(-len(self._hits) // self.max_batch)
        job = next((j for j in self._prefills if j.future is fut), None)
        if job is None:  # boosted already: behind the misses before it
            for other in self._misses:
                if other.future is fut:
                    job = other
                    break
                ahead += self._job_s(other)
                steps += 1
        elif job.started is None:  # boost appends it behind every queued miss
            ahead += sum(self._job_s(j) for j in self._misses)
            steps += len(self._misses)
        if job is not None:
            self._check_deadline(deadline, ahead + self._job_s(job) + self.hit_cost.predict(1), steps + 1)

    def _expired(self, deadline: float | None, now: float | None = None) -> bool:
        return deadline is not None and (self.clock() if now is None else now) >= deadline

    def _drop(self, fut: asyncio.Future[Any]) -> None:
        self.dropped_expired += 1
        if not fut.done():
            fut.set_exception(DeadlineExceeded("deadline passed while queued; dropped before compute"))

    def _job(self, prefix: PrefixTokens, base: PrefixKV | None, item: RankItem | None = None,
             deadline: float | None = None, keep: bool = False) -> _Job:
        if base is not None and not base.live:  # its arena range was freed: compute from scratch
            base = None
        kv = base if base is not None else self.engine.empty_prefix()
        n = len(prefix)
        if kv.length > n:
            raise ValueError(f"the base prefix ({kv.length} tokens) is longer than the prefix ({n})")
        fut = asyncio.get_running_loop().create_future()
        job = _Job(fut, self.clock(), prefix, kv, kv.length, item, deadline)
        short = item is not None and base is None and n <= self.engine.chunk  # ranked by full inference
        room = None
        if self.reserve is not None and not short and n:
            room = self.reserve(n, base, evict=item is None or base is not None or keep)
        if room is not None:
            job.kv, job.reserved = room, True
        if job.kv.pin():
            job.pinned.append(job.kv)
        return job

    def _end(self, job: _Job, *, keep: bool) -> None:
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
        self._admit_rank()
        self._admit_hit(deadline)
        if not kv.pin():
            raise ValueError("the cached prefix was evicted and its arena range freed before the rank was queued")
        fut = asyncio.get_running_loop().create_future()
        self._hits.append(_Hit(kv, item, fut, self.clock(), deadline))
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
        self._admit_rank()
        prefix = self.engine.item_tokens(item)
        if self.admission_margin_s is not None and deadline is not None:
            kv = base if base is not None and base.live else self.engine.empty_prefix()
            probe = _Job(asyncio.get_running_loop().create_future(), 0.0, prefix, kv, kv.length, item)
            self._admit_miss(deadline, self._job_s(probe))
        job = self._job(prefix, base, item, deadline, keep)
        self._misses.append(job)
        self._wake.set()
        return await job.future

    def submit_prefill(self, items: Any, ts: Any, base: PrefixKV | None = None,
                       prefix: PrefixTokens | None = None) -> asyncio.Future[tuple[PrefixKV, Timing]]:
        """Queues a prefill of the prefix ``items``/``ts`` (or of the token stream ``prefix``, for a model
        that reads actions or user context: :meth:`RelayEngine.prefix_tokens`), continuing ``base`` (the K/V
        of its first ``base.length`` tokens) when given, and returns its future (a handle for :meth:`boost`)."""
        depth = len(self._prefills)
        if self.max_prefill_queue is not None and depth >= self.max_prefill_queue:
            raise QueueFull("prefill", depth, self.retry_after_s)
        if prefix is None:
            prefix = self.engine.prefix_tokens(np.asarray(items, dtype=np.int64), np.asarray(ts, dtype=np.int64))
        job = self._job(prefix, base)
        self._prefills.append(job)
        self._wake.set()
        return job.future

    async def prefill(self, items: Any, ts: Any, base: PrefixKV | None = None,
                      prefix: PrefixTokens | None = None) -> tuple[PrefixKV, Timing]:
        return await self.submit_prefill(items, ts, base, prefix)

    def boost(self, fut: asyncio.Future[Any]) -> bool:
        """A rank waits on this prefill: it moves from the prefill queue to the rank queue (behind the
        misses already there, ahead of every other prefill). False if it is not queued as a prefill."""
        for i, job in enumerate(self._prefills):
            if job.future is fut:
                del self._prefills[i]
                if job.started is not None:
                    self._misses.appendleft(job)  # in progress: it finishes before any other rank work
                else:
                    self._misses.append(job)
                self._wake.set()
                return True
        return False

    # -- the loop -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._hits or self._misses or self._prefills):
                self._wake.clear()
                await self._wake.wait()
                continue
            starve = self._prefills and self._critical_streak >= self.prefill_every
            if self._hits and not starve:
                await self._step_hits(loop)
                self._critical_streak += 1
            elif self._misses and not starve:
                await self._step_misses(loop)
                self._critical_streak += 1
            else:
                self._critical_streak = 0
                await self._step_chunks(loop, self._prefills)

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
        popped = [self._hits.popleft() for _ in range(min(self.max_batch, len(self._hits)))]
        try:
            await self._rank_hits(loop, popped)
        finally:
            for h in popped:
                h.kv.unpin()

    async def _rank_hits(self, loop: asyncio.AbstractEventLoop, popped: list[_Hit]) -> None:
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
        t0 = time.perf_counter()
        self._expect(self.hit_cost.predict(len(batch)))
        try:
            out = await loop.run_in_executor(self._executor, self.engine.rank_cached,
                                             [h.kv for h in batch], [h.item for h in batch])
        except Exception as exc:
            for h in batch:
                if not h.future.done():
                    h.future.set_exception(exc)
            return
        finally:
            self._running_until = None
            self._account("rank_cached", time.perf_counter() - t0)
        self.hit_cost.add(len(batch), time.perf_counter() - t0)
        end = self.clock()
        for h, logits in zip(batch, out, strict=True):
            if not h.future.done():
                h.future.set_result((logits, Timing((start - h.enqueued) * 1e3, (end - start) * 1e3)))

    def _short_miss(self, job: _Job) -> bool:
        """An unstarted miss with no base whose history fits one chunk: ranked by full inference."""
        return job.item is not None and job.started is None and job.base_len == 0 \
            and job.tokens <= self.engine.chunk

    async def _step_misses(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._short_miss(self._misses[0]):
            await self._step_chunks(loop, self._misses)
            return
        # Unstarted short misses are ranked together: one batched full inference, of at most max_step_tokens
        # tokens (at least one miss), first come first served.
        batch: list[_Job] = []
        now, used = self.clock(), 0
        while self._misses and len(batch) < self.max_batch and self._short_miss(self._misses[0]):
            if batch and self.max_step_tokens is not None and used + self._misses[0].tokens > self.max_step_tokens:
                break
            job = self._misses.popleft()
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
        t0 = time.perf_counter()
        tokens = sum(j.tokens for j in batch)
        self._expect(self.full_cost.predict(tokens))
        try:
            items = [item for j in batch if (item := j.item) is not None]  # short misses: all rank requests
            out = await loop.run_in_executor(self._executor, self.engine.rank_full, items)
        except Exception as exc:
            for j in batch:
                if not j.future.done():
                    j.future.set_exception(exc)
            return
        finally:
            self._running_until = None
            self._account("rank_full", time.perf_counter() - t0)
        self.full_cost.add(tokens, time.perf_counter() - t0)
        self._count_tokens(tokens, tokens)
        end = self.clock()
        for j, logits in zip(batch, out, strict=True):
            if not j.future.done():
                j.future.set_result(((logits, None), Timing((start - j.enqueued) * 1e3, (end - start) * 1e3)))

    def _collect(self, queue: deque[_Job]) -> list[tuple[_Job, int]]:
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
        return list(zip(jobs, self._shares([j.remaining for j in jobs]), strict=False))

    def _compute_chunks(self, plan: list[tuple[_Job, int]]) -> tuple[list[PrefixKV], list[torch.Tensor | None],
                                                                      float, float]:
        """Compute thread: each job's next ``n`` tokens, all in one call, then one cached-prefix ranking of the
        misses whose prefix is complete. Returns the new prefixes, logits, and the two parts' seconds."""
        t0 = time.perf_counter()
        jobs = [j for j, _ in plan]
        chunks = [j.next_chunk(n) for j, n in plan]
        kvs = self.engine.extend_many([j.kv for j in jobs], [c.items for c in chunks], [c.ts for c in chunks],
                                      [c.actions for c in chunks], [c.context for c in chunks])
        t1 = time.perf_counter()
        done = [b for b, j in enumerate(jobs) if j.item is not None and kvs[b].length == j.tokens]
        logits: list[torch.Tensor | None] = [None] * len(jobs)
        if done:
            out = self.engine.rank_cached([kvs[b] for b in done], [jobs[b].item for b in done])  # type: ignore[misc]
            for b, lg in zip(done, out, strict=True):
                logits[b] = lg
        return kvs, logits, t1 - t0, time.perf_counter() - t1

    async def _step_chunks(self, loop: asyncio.AbstractEventLoop, queue: deque[_Job]) -> None:
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
            groups = [(batch, first, await loop.run_in_executor(self._executor, self._compute_chunks, plan))]
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            groups = []  # isolate the failing member: the others are computed one by one
            for (j, n), f in zip(plan, first, strict=True):
                try:
                    groups.append(([j], [f], await loop.run_in_executor(self._executor, self._compute_chunks,
                                                                         [(j, n)])))
                except Exception as one:
                    self._fail(j, one)
        finally:
            self._running_until = None
        for jobs, firsts, (kvs, logits, extend_s, rank_s) in groups:
            self._apply(jobs, firsts, kvs, logits, extend_s, rank_s)

    def _expect(self, seconds: float) -> None:
        self._running_until = self.clock() + seconds

    def _apply(self, jobs: list[_Job], first: list[bool], kvs: list[PrefixKV], logits: list[torch.Tensor | None],
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
            self._remove(j)
            value = kv if j.item is None else (lg, kv)
            self._end(j, keep=not j.future.done())
            if not j.future.done():
                assert j.started is not None  # _step_chunks set it before the job's first step
                j.future.set_result((value, Timing((j.started - j.enqueued) * 1e3, (end - j.started) * 1e3)))

    def _fail(self, job: _Job, exc: Exception) -> None:
        self._remove(job)
        self._end(job, keep=False)
        if not job.future.done():
            job.future.set_exception(exc)

    def _remove(self, job: _Job) -> None:
        """Takes ``job`` off whichever queue holds it (a boosted prefill moves while it runs)."""
        for queue in (self._misses, self._prefills):
            for i, other in enumerate(queue):
                if other is job:
                    del queue[i]
                    return

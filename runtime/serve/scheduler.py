"""The ranker's compute loop: one compute thread, concurrent requests batched, prefills interleaved.

Work is done in steps on a single executor thread (torch releases the GIL, so the event loop keeps
accepting requests meanwhile). Each step is one of, in priority order:

1. a batch of **cached ranks** — every queued request whose prefix K/V is at hand, up to ``max_batch``;
2. one step of a **full rank** (a cache miss): a chunk of its history, or its final ranking; several
   queued misses with short histories are ranked together in one step;
3. one chunk of a **prefill**.

Ranks are latency-critical and prefills are not, but a prefill must not starve: after ``prefill_every``
consecutive rank steps with prefills waiting, one prefill chunk runs. Chunking keeps any rank from
waiting behind more than one chunk of a long prefill.

Overload: the rank queues (hits and misses together) hold at most ``max_queue`` requests and the prefill
queue ``max_prefill_queue``; beyond that a submission raises :class:`QueueFull` at once (the ranker answers
503 with ``Retry-After``), nothing already queued is touched. A rank may carry a deadline (scheduler
clock): a request whose deadline has passed is dropped before any of its compute runs (and a full rank
between its chunks) with :class:`DeadlineExceeded`. A rank that needs a prefix being prefilled joins that
prefill: :meth:`boost` moves the prefill into the rank queue, ahead of the remaining prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from grstack.runtime.serve.engine import PrefixKV, RankItem, RelayEngine


class QueueFull(Exception):
    """The queue for this kind of work is at its bound; retry after ``retry_after_s``."""

    def __init__(self, queue: str, depth: int, retry_after_s: float) -> None:
        super().__init__(f"{queue} queue full ({depth} waiting)")
        self.queue = queue
        self.depth = depth
        self.retry_after_s = retry_after_s


class DeadlineExceeded(Exception):
    """The request's deadline passed before its compute ran; it was dropped, not computed."""


@dataclass
class Timing:
    queue_ms: float
    compute_ms: float


@dataclass
class _Job:
    gen: Generator[None, None, Any]
    future: asyncio.Future[tuple[Any, Timing]]
    enqueued: float
    started: float | None = None
    tokens: int = 0
    item: RankItem | None = None
    deadline: float | None = None


@dataclass
class _Hit:
    kv: PrefixKV
    item: RankItem
    future: asyncio.Future[tuple[torch.Tensor, Timing]]
    enqueued: float
    deadline: float | None = None


def _advance(gen: Generator[None, None, Any]) -> tuple[bool, Any]:
    try:
        next(gen)
    except StopIteration as stop:
        return True, stop.value
    return False, None


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
    _hits: deque[_Hit] = field(default_factory=deque)
    _misses: deque[_Job] = field(default_factory=deque)
    _prefills: deque[_Job] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranker-compute")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._critical_streak = 0
        self.dropped_expired = 0

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

    def _admit_rank(self) -> None:
        depth = len(self._hits) + len(self._misses)
        if self.max_queue is not None and depth >= self.max_queue:
            raise QueueFull("rank", depth, self.retry_after_s)

    def _expired(self, deadline: float | None, now: float | None = None) -> bool:
        return deadline is not None and (self.clock() if now is None else now) >= deadline

    def _drop(self, fut: asyncio.Future[Any]) -> None:
        self.dropped_expired += 1
        if not fut.done():
            fut.set_exception(DeadlineExceeded("deadline passed while queued; dropped before compute"))

    async def rank_cached(self, kv: PrefixKV, item: RankItem,
                          deadline: float | None = None) -> tuple[torch.Tensor, Timing]:
        self._admit_rank()
        fut = asyncio.get_running_loop().create_future()
        self._hits.append(_Hit(kv, item, fut, self.clock(), deadline))
        self._wake.set()
        return await fut

    async def rank_full(self, item: RankItem, deadline: float | None = None) -> tuple[torch.Tensor, Timing]:
        self._admit_rank()
        fut = asyncio.get_running_loop().create_future()
        self._misses.append(_Job(self._full_gen(item), fut, self.clock(), tokens=len(item.long_items),
                                 item=item, deadline=deadline))
        self._wake.set()
        return await fut

    def submit_prefill(self, items: Any, ts: Any) -> asyncio.Future[tuple[PrefixKV, Timing]]:
        """Queues a prefill and returns its future (a handle for :meth:`boost`)."""
        depth = len(self._prefills)
        if self.max_prefill_queue is not None and depth >= self.max_prefill_queue:
            raise QueueFull("prefill", depth, self.retry_after_s)
        fut: asyncio.Future[tuple[PrefixKV, Timing]] = asyncio.get_running_loop().create_future()
        self._prefills.append(_Job(self._prefill_gen(items, ts), fut, self.clock(), tokens=len(items)))
        self._wake.set()
        return fut

    async def prefill(self, items: Any, ts: Any) -> tuple[PrefixKV, Timing]:
        return await self.submit_prefill(items, ts)

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

    # -- generators (compute thread) ----------------------------------------------------------------
    def _prefill_gen(self, items: Any, ts: Any) -> Generator[None, None, PrefixKV]:
        prefix = self.engine.empty_prefix()
        for start in range(0, len(items), self.engine.chunk):
            if start:
                yield
            prefix = self.engine.extend(prefix, items[start:start + self.engine.chunk],
                                        ts[start:start + self.engine.chunk])
        return prefix

    def _full_gen(self, item: RankItem) -> Generator[None, None, torch.Tensor]:
        prefix = yield from self._prefill_gen(item.long_items, item.long_ts)
        return self.engine.rank_cached([prefix], [item])[0]

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
                await self._step_job(loop, self._prefills)

    async def _step_hits(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = [self._hits.popleft() for _ in range(min(self.max_batch, len(self._hits)))]
        batch = [h for h in batch if not h.future.cancelled()]
        now = self.clock()
        for h in [h for h in batch if self._expired(h.deadline, now)]:
            self._drop(h.future)
        batch = [h for h in batch if not self._expired(h.deadline, now)]
        if not batch:
            return
        start = self.clock()
        if self.on_batch is not None:
            self.on_batch(len(batch))
        try:
            out = await loop.run_in_executor(self._executor, self.engine.rank_cached,
                                             [h.kv for h in batch], [h.item for h in batch])
        except Exception as exc:
            for h in batch:
                if not h.future.done():
                    h.future.set_exception(exc)
            return
        end = self.clock()
        for h, logits in zip(batch, out, strict=True):
            if not h.future.done():
                h.future.set_result((logits, Timing((start - h.enqueued) * 1e3, (end - start) * 1e3)))

    async def _step_misses(self, loop: asyncio.AbstractEventLoop) -> None:
        head = self._misses[0]
        if head.item is not None and head.started is None and head.tokens <= self.engine.chunk:
            # Unstarted short misses are ranked together: one chunk each, one batched ranking.
            batch: list[_Job] = []
            now = self.clock()
            while (self._misses and len(batch) < self.max_batch and self._misses[0].started is None
                   and self._misses[0].item is not None and self._misses[0].tokens <= self.engine.chunk):
                job = self._misses.popleft()
                if self._expired(job.deadline, now):
                    self._drop(job.future)
                elif not job.future.cancelled():
                    batch.append(job)
            if not batch:
                return
            start = self.clock()
            if self.on_batch is not None:
                self.on_batch(len(batch))
            try:
                out = await loop.run_in_executor(self._executor, self.engine.rank_full,
                                                 [j.item for j in batch])
            except Exception as exc:
                for j in batch:
                    if not j.future.done():
                        j.future.set_exception(exc)
                return
            end = self.clock()
            for j, logits in zip(batch, out, strict=True):
                if not j.future.done():
                    j.future.set_result((logits, Timing((start - j.enqueued) * 1e3, (end - start) * 1e3)))
            return
        await self._step_job(loop, self._misses)

    async def _step_job(self, loop: asyncio.AbstractEventLoop, queue: deque[_Job]) -> None:
        job = queue[0]
        if job.future.cancelled():
            queue.popleft()
            return
        if self._expired(job.deadline):  # before its first chunk, or between chunks
            queue.popleft()
            self._drop(job.future)
            return
        if job.started is None:
            job.started = self.clock()
        try:
            done, value = await loop.run_in_executor(self._executor, _advance, job.gen)
        except Exception as exc:
            self._remove(job)
            if not job.future.done():
                job.future.set_exception(exc)
            return
        if done:
            self._remove(job)
            end = self.clock()
            if not job.future.done():
                job.future.set_result((value, Timing((job.started - job.enqueued) * 1e3,
                                                     (end - job.started) * 1e3)))

    def _remove(self, job: _Job) -> None:
        """Takes ``job`` off whichever queue holds it (a boosted prefill moves while it runs)."""
        for queue in (self._misses, self._prefills):
            for i, other in enumerate(queue):
                if other is job:
                    del queue[i]
                    return

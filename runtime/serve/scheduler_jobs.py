"""The compute loop's work items and queues, shared by its admission policy and its executor loop."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from grstack.runtime.serve.engine import PrefixKV, PrefixTokens, RankItem


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


@dataclass
class Timing:
    queue_ms: float
    compute_ms: float


@dataclass
class Job:
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

    def short(self, chunk: int) -> bool:
        """An unstarted miss with no base whose history fits one ``chunk``: ranked by full inference."""
        return self.item is not None and self.started is None and self.base_len == 0 and self.tokens <= chunk


@dataclass
class Hit:
    kv: PrefixKV
    item: RankItem
    future: asyncio.Future[tuple[torch.Tensor, Timing]]
    enqueued: float
    deadline: float | None = None


@dataclass
class WorkQueues:
    """Queued work in priority order (cached ranks, rank misses, prefills), the rank steps run since the last
    prefill step, and when the step on the compute thread is expected to end."""

    hits: deque[Hit] = field(default_factory=deque)
    misses: deque[Job] = field(default_factory=deque)
    prefills: deque[Job] = field(default_factory=deque)
    critical_streak: int = 0
    running_until: float | None = None

    def depth(self) -> dict[str, int]:
        return {"hits": len(self.hits), "misses": len(self.misses), "prefills": len(self.prefills)}

    def ranks(self) -> int:
        """Ranks queued, hits and misses."""
        return len(self.hits) + len(self.misses)

    def backlog_tokens(self) -> int:
        """Prefix tokens still to compute for the queued misses and prefills."""
        return sum(j.remaining for j in self.misses) + sum(j.remaining for j in self.prefills)

    def boost(self, fut: asyncio.Future[Any]) -> bool:
        """A rank waits on this prefill: it moves from the prefill queue to the rank queue (behind the
        misses already there, ahead of every other prefill). False if it is not queued as a prefill."""
        for i, job in enumerate(self.prefills):
            if job.future is fut:
                del self.prefills[i]
                if job.started is not None:
                    self.misses.appendleft(job)  # in progress: it finishes before any other rank work
                else:
                    self.misses.append(job)
                return True
        return False

    def remove(self, job: Job) -> None:
        """Takes ``job`` off whichever queue holds it (a boosted prefill moves while it runs)."""
        for queue in (self.misses, self.prefills):
            for i, other in enumerate(queue):
                if other is job:
                    del queue[i]
                    return

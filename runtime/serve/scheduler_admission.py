"""Admission of the compute loop's work: what is queued and what is refused at once.

A submission beyond its queue's bound raises :class:`QueueFull` (the ranker answers 503 with ``Retry-After``).
With a margin, a rank predicted to finish after its deadline behind the work already queued (the step cost
models fitted online, the starvation guard's prefill steps and the models' error included) raises
:class:`PredictedLate`, so that the caller goes elsewhere now instead of learning it at the deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from grstack.runtime.serve.clock import Now
from grstack.runtime.serve.scheduler_jobs import Job, WorkQueues, step_shares


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


@dataclass
class AdmissionPolicy:
    """Reads ``queues`` (never changes them) and the step costs the executor loop feeds (``hit_cost``: a batched
    cached-prefix rank step, by ranks; ``token_cost``: a chunk step, by new prefix tokens; ``full_cost``: a
    batched full inference of short misses, by tokens)."""

    queues: WorkQueues
    clock: Now
    chunk: int
    max_batch: int
    prefill_every: int
    max_step_tokens: int | None
    max_queue: int | None
    max_prefill_queue: int | None
    retry_after_s: float
    margin_s: float | None  # None: no deadline prediction
    hit_cost: StepCost = field(default_factory=StepCost)
    token_cost: StepCost = field(default_factory=StepCost)
    full_cost: StepCost = field(default_factory=StepCost)

    def admit_rank(self) -> None:
        depth = self.queues.ranks()
        if self.max_queue is not None and depth >= self.max_queue:
            raise QueueFull("rank", depth, self.retry_after_s)

    def admit_prefill(self) -> None:
        depth = len(self.queues.prefills)
        if self.max_prefill_queue is not None and depth >= self.max_prefill_queue:
            raise QueueFull("prefill", depth, self.retry_after_s)

    def shares(self, remaining: list[int]) -> list[int]:
        """New tokens of the next chunk step's jobs (:func:`step_shares` with this loop's bounds)."""
        return step_shares(remaining, max_jobs=self.max_batch, chunk=self.chunk, budget=self.max_step_tokens)

    def hits_s(self, count: int) -> float:
        """Predicted seconds of ``count`` cached ranks, in steps of ``max_batch``."""
        full, rest = divmod(count, self.max_batch)
        return full * self.hit_cost.predict(self.max_batch) + (self.hit_cost.predict(rest) if rest else 0.0)

    def job_s(self, job: Job) -> float:
        """Predicted seconds of what is left of a miss or prefill: its steps (of up to ``max_step_tokens``, or
        one chunk each without a bound) and, for a miss computed in steps, the cached-prefix rank after them;
        a short miss is one full inference."""
        if job.short(self.chunk):
            return self.full_cost.predict(job.tokens)
        unit = self.max_step_tokens or self.chunk
        full, rest = divmod(job.remaining, unit)
        s = full * self.token_cost.predict(unit) + (self.token_cost.predict(rest) if rest else 0.0)
        return s + (self.hit_cost.predict(1) if job.item is not None else 0.0)

    def prefill_step_tokens(self) -> int:
        """New tokens of the next prefill step (as the executor loop batches them)."""
        return sum(self.shares([j.remaining for j in self.queues.prefills]))

    def check_deadline(self, deadline: float, work_s: float, rank_steps: int) -> None:
        """Raises :class:`PredictedLate` when ``work_s`` of queued work (``rank_steps`` steps, the request's own
        included) after the running step, with the prefill steps the starvation guard runs between them and
        the models' error, would end later than ``deadline`` minus the margin."""
        now, q = self.clock(), self.queues
        running = 0.0 if q.running_until is None else max(0.0, q.running_until - now)
        prefill_steps = (rank_steps + q.critical_streak) // self.prefill_every if q.prefills else 0
        prefills = prefill_steps * self.token_cost.predict(self.prefill_step_tokens())
        error = max(self.hit_cost.dev, self.token_cost.dev, self.full_cost.dev)
        total = running + work_s + prefills + error
        late = now + total + (self.margin_s or 0.0) - deadline
        if late > 0:
            depth = len(self.queues.hits) + len(self.queues.misses)
            raise PredictedLate("rank", depth, self.retry_after_s,
                                f"predicted to finish {late * 1e3:.0f} ms after its deadline ({total * 1e3:.0f} ms "
                                f"of compute before its answer, {depth} ranks queued)")

    def admit_hit(self, deadline: float | None) -> None:
        """Cached ranks run before every miss: only the queued hits are ahead of a new one."""
        if self.margin_s is None or deadline is None:
            return
        n = len(self.queues.hits) + 1
        self.check_deadline(deadline, self.hits_s(n), -(-n // self.max_batch))

    def admit_miss(self, deadline: float | None, job_s: float) -> None:
        if self.margin_s is None or deadline is None:
            return
        ahead = self.hits_s(len(self.queues.hits)) + sum(self.job_s(j) for j in self.queues.misses)
        steps = -(-len(self.queues.hits) // self.max_batch) + len(self.queues.misses) + 1
        self.check_deadline(deadline, ahead + job_s, steps)

    def check_join(self, fut: asyncio.Future[Any], deadline: float | None) -> None:
        """A rank about to join the prefill behind ``fut``: raises :class:`PredictedLate` when that prefill,
        where :meth:`boost` puts it in the rank queue, and the rank after it are predicted to end past
        ``deadline``. Call it before :meth:`boost`, so that a refused rank raises no prefill's priority."""
        if self.margin_s is None or deadline is None:
            return
        ahead, steps = self.hits_s(len(self.queues.hits)), -(-len(self.queues.hits) // self.max_batch)
        job = next((j for j in self.queues.prefills if j.future is fut), None)
        if job is None:  # boosted already: behind the misses before it
            for other in self.queues.misses:
                if other.future is fut:
                    job = other
                    break
                ahead += self.job_s(other)
                steps += 1
        elif job.started is None:  # boost appends it behind every queued miss
            ahead += sum(self.job_s(j) for j in self.queues.misses)
            steps += len(self.queues.misses)
        if job is not None:
            self.check_deadline(deadline, ahead + self.job_s(job) + self.hit_cost.predict(1), steps + 1)

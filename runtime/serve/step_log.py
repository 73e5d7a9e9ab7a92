"""What a ranker spent in service, step by step: the compute loop's steps and each request's CPU outside them.

A cost model fitted to these (``cost_profile``) is what a simulator replays, so they are logged in real runs,
not in a start-up probe: an idle profile and in-service costs differed about 2x. The logs are bounded rings
(a long-running ranker does not grow); each record has a sequence number, so a reader that polls with the
last one it saw gets only what is new and learns how many it missed (``dropped``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Generic, TypeVar

STEP_KINDS = ("rank_cached", "rank_full", "extend_many")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One call of the tensor math. ``batch``: users in it; ``tokens``: new tokens computed; ``context``: cached
    prefix tokens they attend to (summed over the batch: the K/V bytes read); ``pairs``: query-key pairs of
    attention (each new token against its user's context and the new tokens before it), what attention's
    FLOPs scale with; ``seconds``: on the scheduler's clock, timed on the compute thread; ``cpu_seconds``: that
    thread's CPU seconds in the step (None where no thread ran it: a simulated replica). On a core shared with
    the event loop, ``seconds - cpu_seconds`` is the time the core gave to others during the step."""

    seq: int
    t: float
    kind: str
    batch: int
    tokens: int
    context: int
    pairs: int
    seconds: float
    cpu_seconds: float | None = None
    cold: int = 0  # context tokens read from the cache, not right after the step that computed them (a hit's)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's CPU on the ranker's event-loop thread outside the compute steps: ``parse_s`` (body to
    model), ``encode_s`` (canonical form, hashing, tokens), ``reply_s`` (scores to JSON). ``events``: long- and
    short-term events it carried; ``candidates``: 0 for a prefill."""

    seq: int
    t: float
    endpoint: str
    events: int
    candidates: int
    parse_s: float
    encode_s: float
    reply_s: float


@dataclass
class RequestCpu:
    """A request's CPU segments as its handler measures them (seconds), logged once it is answered."""

    parse_s: float = 0.0
    encode_s: float = 0.0
    reply_s: float = 0.0


def attention_pairs(new: Sequence[int], context: Sequence[int]) -> int:
    """Query-key pairs of a batch: each user's ``new`` tokens against its ``context`` and, causally, against
    the new tokens before them (n·c + n(n+1)/2 per user)."""
    return sum(n * c + n * (n + 1) // 2 for n, c in zip(new, context, strict=True))


class Ring(Generic[T]):
    """The last ``capacity`` records appended, numbered from 1 in append order."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a log ring holds at least one record (capacity {capacity})")
        self.capacity = capacity
        self._items: deque[T] = deque(maxlen=capacity)
        self.appended = 0

    def append(self, item: T) -> None:
        self._items.append(item)
        self.appended += 1

    def __len__(self) -> int:
        return len(self._items)

    def next_seq(self) -> int:
        return self.appended + 1

    def last(self, n: int) -> list[T]:
        """The ``n`` most recent records (fewer when fewer are held), oldest first."""
        return list(islice(reversed(self._items), max(n, 0)))[::-1]

    def since(self, seq: int = 0) -> tuple[list[T], int]:
        """The records numbered above ``seq`` still held, and how many above it were overwritten before this
        read (the reader polled too rarely for the ring's capacity)."""
        seq = max(seq, 0)
        first = self.appended - len(self._items) + 1  # the oldest record's number
        start = max(seq + 1, first)
        dropped = max(0, first - (seq + 1))
        items = list(self._items)[start - first:] if start <= self.appended else []
        return items, dropped


class StepLog:
    """The scheduler's step ring and the ranker's request ring."""

    def __init__(self, capacity: int = 16384) -> None:
        self.steps: Ring[StepRecord] = Ring(capacity)
        self.requests: Ring[RequestRecord] = Ring(capacity)

    def step(self, t: float, kind: str, new: Sequence[int], context: Sequence[int], seconds: float,
             cpu_seconds: float | None = None, cold: bool = False) -> None:
        """Logs a step of ``len(new)`` users computing ``new[i]`` tokens against ``context[i]`` cached ones;
        ``cold``: that context was read from the cache (a hit's ranking), not just computed."""
        self.steps.append(StepRecord(self.steps.next_seq(), t, kind, len(new), sum(new), sum(context),
                                     attention_pairs(new, context), seconds, cpu_seconds,
                                     sum(context) if cold else 0))

    def request(self, t: float, endpoint: str, events: int, candidates: int, cpu: RequestCpu) -> None:
        self.requests.append(RequestRecord(self.requests.next_seq(), t, endpoint, events, candidates, cpu.parse_s,
                                           cpu.encode_s, cpu.reply_s))

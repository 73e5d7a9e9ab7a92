"""The batch schedule when every rank reads only its share of the data (``data.read: shard``).

Rows cannot move between ranks, so a global step is not cut from one global order and split across ranks
(``batching.Schedule``); instead every rank takes the next rows of its own epoch order
(``data.shards.epoch_order``) until its cost reaches the step's target, the same target on every rank:

* ``balance.mode: tokens``: the target is ``token_budget`` tokens' worth of cost (or ``batch_size / W``
  sequences' worth without a budget) at the data's mean cost, cost ``a·L + b·L²`` with the run's weights.
  A rank fills in order; when the next row would overshoot, it takes the row among its next ``lookahead``
  whose cost best fills the gap, and stops when no row brings it closer to the target, overshooting
  counted W-1 times (one rank over the target makes the W-1 others wait); rows passed over stay in the
  queue for later steps. A row costlier than the target, at the head of some rank's queue,
  raises that step's target to its cost on every rank: it is a step of its own there, and the others fill
  to it instead of waiting.
* ``balance.mode: count``: ``batch_size / W`` rows per rank (the baseline).

Every rank computes every rank's fill from the gathered per-piece lengths alone (no rows move), so all
agree on the steps. An epoch ends at the first step some rank cannot complete; the rows left on the other
ranks are reshuffled into the next epoch (``dropped`` counts them).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from grstack.runtime.data import JaggedBatch, RankShare, epoch_order
from grstack.runtime.train import balance
from grstack.runtime.train.batching import Schedule
from grstack.runtime.training_config import Config

LOOKAHEAD = 64  # rows a rank may look ahead of its queue for the row that best fills a step


class _Queue:
    """One rank's epoch queue: costs in order, which positions are taken, the first untaken one."""

    def __init__(self, costs: np.ndarray) -> None:
        self.c = np.asarray(costs, dtype=np.float64)
        self.used = np.zeros(len(self.c), dtype=bool)
        self.ptr = 0

    def head(self) -> int | None:
        while self.ptr < len(self.c) and self.used[self.ptr]:
            self.ptr += 1
        return self.ptr if self.ptr < len(self.c) else None

    def fill(self, target: float, lookahead: int, over: float) -> np.ndarray | None:
        """Positions of one step near ``target`` in cost, or None when the queue runs out inside it. Going
        over the target costs ``over`` times what falling short does (a rank over the target makes every
        other rank wait; one short of it waits alone)."""
        acc, take = 0.0, []
        while True:
            head = self.head()
            if head is None:
                return None
            if not take or acc + self.c[head] <= target:
                pick = head
            else:
                window = np.arange(head, min(len(self.c), head + 4 * lookahead))
                window = window[~self.used[window]][:lookahead]
                gap = target - acc
                left = gap - self.c[window]
                miss = np.where(left >= 0, left, -over * left)
                j = int(np.argmin(miss))
                if miss[j] >= (gap if gap >= 0 else -over * gap):
                    return np.asarray(take, dtype=np.int64)
                pick = int(window[j])
            self.used[pick] = True
            take.append(pick)
            acc += self.c[pick]


def fill_by_cost(costs: list[np.ndarray], target: float, lookahead: int = LOOKAHEAD) -> list[list[np.ndarray]]:
    """Per rank, the positions (into its queue with these costs) of each complete step. A step's target is
    ``target``, raised to the costliest row at the head of any rank's queue (that row is a step of its own
    there, and the other ranks fill to its cost rather than wait for it)."""
    queues = [_Queue(c) for c in costs]
    steps: list[list[np.ndarray]] = [[] for _ in queues]
    while True:
        heads = [q.head() for q in queues]
        if any(h is None for h in heads):
            return steps
        step_target = max(target, *(float(q.c[h]) for q, h in zip(queues, heads, strict=True)))
        picks = [q.fill(step_target, lookahead, max(1, len(queues) - 1)) for q in queues]
        if any(p is None for p in picks):
            return steps  # some queue ran out inside this step: it is not a complete step
        for r, p in enumerate(picks):
            steps[r].append(p)


def fill_by_count(n: int, per_rank: int) -> list[np.ndarray]:
    return [np.arange(lo, lo + per_rank) for lo in range(0, n - per_rank + 1, per_rank)]


class ShardSchedule(Schedule):
    """``Schedule``'s interface over rank-local data: global row ids are ``base[rank] + local row``."""

    def __init__(self, share: RankShare, piece_lengths: list[list[np.ndarray]], cfg: Config, world_size: int,
                 rank: int, ranking_candidates: int) -> None:
        self.cfg, self.world_size, self.rank = cfg, world_size, rank
        self.extra_tokens = ranking_candidates
        self.piece_lengths = piece_lengths
        per_rank = [np.concatenate([*p, np.zeros(0, np.int64)]).astype(np.int64) for p in piece_lengths]
        self.bases = np.concatenate([[0], np.cumsum([len(x) for x in per_rank])]).astype(np.int64)
        self.lengths = np.concatenate(per_rank)
        self.split = _ShareSplit(share, int(self.bases[rank]))
        self.cost_a, self.cost_b = cfg.balance.cost_a, cfg.balance.cost_b
        self._cache: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self._steps: dict[int, int] = {}
        self.dropped: dict[int, int] = {}
        self._lock = threading.Lock()

    def own_rows(self) -> np.ndarray:
        return np.arange(self.bases[self.rank], self.bases[self.rank + 1])

    def set_weights(self, a: float, b: float) -> None:
        super().set_weights(a, b)
        with self._lock:
            self._cache, self._steps, self.dropped = {}, {}, {}

    def _target(self) -> tuple[str, float]:
        b, t = self.cfg.balance, self.cfg.train
        L = self.lengths + self.extra_tokens
        if b.mode == "count":
            return "count", float(max(1, t.batch_size // self.world_size))
        cost = balance.sequence_cost(L, self.cost_a, self.cost_b)
        if b.token_budget is not None:
            return "tokens", float(b.token_budget * cost.sum() / max(L.sum(), 1))
        return "tokens", float(t.batch_size / self.world_size * cost.mean())

    def epoch(self, epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        with self._lock:
            if epoch not in self._cache:
                mode, target = self._target()
                orders = [epoch_order(lengths, self.cfg.train.seed, epoch, r, self.cfg.data.shuffle_window)
                          for r, lengths in enumerate(self.piece_lengths)]
                if mode == "count":
                    picks = [fill_by_count(len(order), int(target)) for order in orders]
                else:
                    picks = fill_by_cost([balance.sequence_cost(self.lengths[self.bases[r] + order]
                                                                + self.extra_tokens, self.cost_a, self.cost_b)
                                          for r, order in enumerate(orders)], target)
                per_rank = [[self.bases[r] + orders[r][p] for p in picks[r]] for r in range(self.world_size)]
                n_steps = min(len(s) for s in per_rank)
                rows = [np.concatenate([per_rank[r][k] for r in range(self.world_size)]) for k in range(n_steps)]
                order = np.concatenate([*rows, np.zeros(0, np.int64)]).astype(np.int64)
                cuts = np.concatenate([[0], np.cumsum([len(x) for x in rows])]).astype(np.int64)
                batches = [np.arange(cuts[k], cuts[k + 1]) for k in range(n_steps)]
                self._cache = {epoch: (order, batches)}
                self._steps[epoch] = n_steps
                self.dropped[epoch] = int(len(self.lengths) - len(order))
            return self._cache[epoch]

    def parts(self, rows: np.ndarray, mode: str | None = None) -> list[np.ndarray]:
        if mode == "count":  # the equal-count baseline the cost model compares with (had rows been movable)
            return super().parts(rows, mode)
        owner = np.searchsorted(self.bases, rows, side="right") - 1
        return [np.flatnonzero(owner == r) for r in range(self.world_size)]


class _ShareSplit:
    """What ``Preparer`` reads of a split: the training batch of global rows, all of them this rank's."""

    def __init__(self, share: RankShare, base: int) -> None:
        self.share, self.base = share, base

    def train_batch(self, rows: np.ndarray, max_len: int, back: np.ndarray | None = None
                    ) -> tuple[JaggedBatch, torch.Tensor]:
        return self.share.train_batch(self._local(rows), max_len, back)

    def train_block(self, rows: np.ndarray, back: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.share.train_block(self._local(rows), back)

    def block_backs(self, rows: np.ndarray, uniform: np.ndarray) -> np.ndarray:
        return self.share.block_backs(self._local(rows), uniform)

    def _local(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64) - self.base

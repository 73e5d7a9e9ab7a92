"""Token-aware batches and global reallocation across ranks (docs/architecture.md §4.2).

A global step takes a slice of the epoch's order: ``batch_size`` sequences, or (token budget) as many
sequences as make ``world_size * token_budget`` tokens. The slice is then split across ranks so that every
rank's cost ``sum(a·L + b·L²)`` is nearly equal: longest-processing-time-first onto the least-loaded rank,
then pairwise moves and swaps between the most and least loaded ranks. Every rank computes the same split
from the sequence lengths alone, so no communication is needed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def sequence_cost(lengths: np.ndarray, a: float, b: float) -> np.ndarray:
    L = np.asarray(lengths, dtype=np.float64)
    return a * L + b * L * L


def imbalance(rank_costs: np.ndarray) -> float:
    """(max - mean) / mean of per-rank cost: the fraction by which the slowest rank exceeds the average.
    Applied to ``rank_costs`` (a·L + b·L²) it is the cost model's figure; to measured busy times, the
    measured one (``measured_balance``)."""
    c = np.asarray(rank_costs, dtype=np.float64)
    mean = c.mean()
    return float((c.max() - mean) / mean) if mean > 0 else 0.0


def wait_ratio(rank_costs: np.ndarray) -> float:
    """sum_r (max - c_r) / (W · max): the share of rank-time spent waiting for the slowest rank, had each
    rank's step taken ``c_r`` (the cost model's cost, or a measured busy time: ``measured_balance``)."""
    c = np.asarray(rank_costs, dtype=np.float64)
    top = c.max()
    return float(((top - c) / top).mean()) if top > 0 else 0.0


def measured_balance(busy_s: Sequence[float]) -> dict[str, float]:
    """A step's balance from every rank's measured busy seconds (what busy counts: ``Engine.step``):
    ``busy_ms_max`` (the slowest rank), ``wait_ratio_measured`` = sum_r (max - busy_r) / (W · max) (the
    share of rank-time spent waiting for the slowest rank at the step's synchronisation) and
    ``imbalance_measured`` = (max - mean) / mean."""
    b = np.asarray(busy_s, dtype=np.float64)
    return {"busy_ms_max": 1e3 * float(b.max()), "wait_ratio_measured": wait_ratio(b),
            "imbalance_measured": imbalance(b)}


def global_batches(token_lengths: np.ndarray, world_size: int, batch_size: int,
                   token_budget: int | None = None) -> list[np.ndarray]:
    """Cuts an epoch (positions 0..n-1 of its order, with their token lengths) into global batches.

    Every batch has at least ``world_size`` sequences (a smaller tail joins the previous batch).
    """
    n = len(token_lengths)
    if n == 0:
        return []
    if token_budget is None:
        cuts = list(range(0, n, batch_size))[1:]
    else:
        target = world_size * token_budget
        cuts, acc, count = [], 0, 0
        for i, length in enumerate(np.asarray(token_lengths).tolist()):
            acc += length
            count += 1
            if acc >= target and count >= world_size and i + 1 < n:
                cuts.append(i + 1)
                acc, count = 0, 0
    bounds = [0, *cuts, n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < world_size:
        bounds.pop(-2)
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def split_by_count(n: int, world_size: int) -> list[np.ndarray]:
    """Contiguous equal-count split (the fixed-count baseline)."""
    return [part.astype(np.int64) for part in np.array_split(np.arange(n), world_size)]


def split_by_cost(costs: np.ndarray, world_size: int, refine_rounds: int = 64) -> list[np.ndarray]:
    """Near-equal-cost split: LPT and the equal-count split, each refined by moves/swaps between the most
    and least loaded ranks; the better of the two (so never worse than equal counts)."""
    costs = np.asarray(costs, dtype=np.float64)
    lpt = np.empty(len(costs), dtype=np.int64)
    heap = [(0.0, r) for r in range(world_size)]
    for i in np.argsort(-costs, kind="stable"):
        load, r = heapq.heappop(heap)
        lpt[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    counted = np.empty(len(costs), dtype=np.int64)
    for r, part in enumerate(split_by_count(len(costs), world_size)):
        counted[part] = r
    best = None
    for owner in (lpt, counted):
        _refine(owner, costs, world_size, refine_rounds)
        top = np.bincount(owner, weights=costs, minlength=world_size).max()
        if best is None or top < best[0]:
            best = (top, owner)
    assert best is not None
    return [np.flatnonzero(best[1] == r) for r in range(world_size)]


def _refine(owner: np.ndarray, costs: np.ndarray, world_size: int, refine_rounds: int) -> None:
    loads = np.bincount(owner, weights=costs, minlength=world_size)
    for _ in range(refine_rounds):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            break
        on_hi = np.flatnonzero(owner == hi)
        on_lo = np.flatnonzero(owner == lo)
        best_gain, move = 0.0, None
        # move one sequence hi -> lo: new max of the pair is max(hi - c, lo + c)
        if len(on_hi) > 1:
            c = costs[on_hi]
            gain = gap - np.abs(gap - 2 * c)
            j = int(np.argmax(gain))
            if gain[j] > best_gain:
                best_gain, move = float(gain[j]), (on_hi[j], None)
        # swap x (on hi) with y (on lo): the pair's gap becomes |gap - 2 (cx - cy)|
        if len(on_lo):
            diff = costs[on_hi][:, None] - costs[on_lo][None, :]
            gain = gap - np.abs(gap - 2 * diff)
            j, k = np.unravel_index(int(np.argmax(gain)), gain.shape)
            if gain[j, k] > best_gain + 1e-12:
                best_gain, move = float(gain[j, k]), (on_hi[j], on_lo[k])
        if move is None or best_gain <= 1e-12:
            break
        x, y = move
        owner[x] = lo
        loads[hi] -= costs[x]
        loads[lo] += costs[x]
        if y is not None:
            owner[y] = hi
            loads[lo] -= costs[y]
            loads[hi] += costs[y]


def assign(token_lengths: np.ndarray, world_size: int, mode: str, a: float, b: float) -> list[np.ndarray]:
    """Positions (into one global batch) each rank trains on, in batch order."""
    if mode == "count":
        return split_by_count(len(token_lengths), world_size)
    return split_by_cost(sequence_cost(token_lengths, a, b), world_size)


def rank_costs(token_lengths: np.ndarray, parts: list[np.ndarray], a: float, b: float) -> np.ndarray:
    cost = sequence_cost(token_lengths, a, b)
    return np.array([cost[p].sum() for p in parts])

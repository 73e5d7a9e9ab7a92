"""Splitting a rank's batch into frozen-window micro-batches, optionally by key-centric clustering.

Parameters are frozen inside a batch, so which sequences share a micro-batch changes only the order of
gradient sums, never what is computed. Clustering puts sequences that share item ids together, so each
micro-batch's deduplicated lookup (and its All2All) carries fewer keys (NestPipe §FWP).
"""

from __future__ import annotations

import numpy as np


def split_contiguous(token_counts: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` non-empty runs of consecutive sequences with about equal tokens each."""
    counts = np.asarray(token_counts, dtype=np.float64)
    m = len(counts)
    n = max(1, min(n, m))
    cum = np.cumsum(counts)
    total = cum[-1] if m else 0.0
    cuts = []
    for k in range(1, n):
        c = int(np.searchsorted(cum, total * k / n, side="left")) + 1
        lo = (cuts[-1] if cuts else 0) + 1
        hi = m - (n - k)
        cuts.append(min(max(c, lo), hi))
    bounds = [0, *cuts, m]
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(n)]


def cluster_by_keys(key_sets: list[np.ndarray], token_counts: np.ndarray, n: int,
                    slack: float = 0.15) -> list[np.ndarray]:
    """Greedy key-centric clustering into ``n`` non-empty micro-batches of about equal tokens.

    Seeds are chosen farthest-first (the longest sequence, then each time the one sharing the fewest keys
    with the seeds so far). The other sequences are placed longest first; each goes to the micro-batch (with
    room left under ``(1 + slack) * tokens / n``) whose key set it overlaps most, ties to the lightest. A
    local search then moves sequences while that lowers the total of unique keys. The same local search is
    run from the contiguous split, and the better of the two is returned, so clustering never transfers more
    keys than the batch order does.
    """
    m = len(key_sets)
    n = max(1, min(n, m))
    counts = np.asarray(token_counts, dtype=np.float64)
    cap = (1.0 + slack) * counts.sum() / n
    sets = [set(np.asarray(k).tolist()) for k in key_sets]
    greedy = _greedy(sets, counts, n, cap)
    plain = [g.tolist() for g in split_contiguous(counts, n)]
    for members in (greedy, plain):
        load = np.array([counts[g].sum() for g in members])
        _refine(members, sets, counts, load, max(cap, float(load.max())))
    best = min((greedy, plain), key=lambda ms: sum(len(set().union(*(sets[i] for i in g))) for g in ms))
    return [np.array(sorted(g), dtype=np.int64) for g in best]


def _greedy(sets: list[set[int]], counts: np.ndarray, n: int, cap: float) -> list[list[int]]:
    m = len(sets)
    order = np.argsort(-counts, kind="stable").tolist()
    seeds = [order[0]]
    nearest = np.array([len(sets[i] & sets[order[0]]) for i in range(m)], dtype=np.float64)
    while len(seeds) < n:
        free = [i for i in order if i not in seeds]
        nxt = min(free, key=lambda i: nearest[i])  # stable: the longest among the least overlapping
        seeds.append(nxt)
        nearest = np.maximum(nearest, [len(sets[i] & sets[nxt]) for i in range(m)])
    members: list[list[int]] = [[s] for s in seeds]
    keys: list[set[int]] = [set(sets[s]) for s in seeds]
    load = np.array([counts[s] for s in seeds])
    seeded = set(seeds)
    for i in order:
        if i in seeded:
            continue
        room = [j for j in range(n) if load[j] + counts[i] <= cap]
        cands = room or [int(np.argmin(load))]
        j = max(cands, key=lambda c: (len(sets[i] & keys[c]), -load[c], -c))
        members[j].append(i)
        keys[j] |= sets[i]
        load[j] += counts[i]
    return members


def _refine(members: list[list[int]], sets: list[set[int]], counts: np.ndarray, load: np.ndarray, cap: float,
            passes: int = 3) -> None:
    """Local search: move a sequence to another micro-batch when that lowers the total number of unique
    keys and keeps the target under ``cap`` (no micro-batch is emptied)."""
    from collections import Counter

    tally = [Counter(k for i in g for k in sets[i]) for g in members]
    where = {i: j for j, g in enumerate(members) for i in g}
    for _ in range(passes):
        moved = False
        for i in sorted(where):
            a = where[i]
            if len(members[a]) == 1:
                continue
            freed = sum(1 for k in sets[i] if tally[a][k] == 1)
            best, best_gain = None, 0
            for b in range(len(members)):
                if b == a or load[b] + counts[i] > cap:
                    continue
                gain = freed - sum(1 for k in sets[i] if tally[b][k] == 0)
                if gain > best_gain:
                    best, best_gain = b, gain
            if best is None:
                continue
            members[a].remove(i)
            members[best].append(i)
            tally[a].subtract(sets[i])
            tally[a] = +tally[a]
            tally[best].update(sets[i])
            load[a] -= counts[i]
            load[best] += counts[i]
            where[i] = best
            moved = True
        if not moved:
            break


def unique_keys(groups: list[np.ndarray], key_sets: list[np.ndarray]) -> list[int]:
    """Deduplicated keys each micro-batch looks up."""
    out = []
    for g in groups:
        parts = [np.asarray(key_sets[i]) for i in g]
        out.append(int(np.unique(np.concatenate(parts)).size) if parts else 0)
    return out

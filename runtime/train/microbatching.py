"""Splitting a rank's batch into frozen-window micro-batches, optionally by key-centric clustering.

Parameters are frozen inside a batch, so which sequences share a micro-batch changes only the order of
gradient sums, never what is computed. Clustering puts sequences that share item ids together, so each
micro-batch's deduplicated lookup (and its All2All) carries fewer keys (NestPipe §FWP).

``cluster_by_keys`` is vectorised (numpy). One pass over the batch's (key, sequence) pairs (a scatter into
a key-by-sequence bitmap when the ids span a small range, else one sort) finds which sequences hold each
key. A key held by one sequence adds exactly one unique key wherever that sequence goes, so it is counted
and dropped; the keys held by two or more are grouped by their holder set, one weighted row per distinct set
(``KeyIncidence``). The greedy placement then needs, per sequence, the weight of its rows each micro-batch
already holds (one bincount over the micro-batches' bit patterns of its rows), and the local search, for
every sequence i and micro-batch c, the weight of i's rows that c holds no copy of (``A0[i, c]``) or exactly
one copy of (``A1[i, c]``): two small matrix products, then updated from the rows whose copy count crosses
0, 1 or 2 when a sequence moves. These are exactly the overlaps and gains the same algorithm computes on
Python sets (``cluster_by_keys_reference``, the original implementation, kept for tests and benchmarks), so
both return the same partition. At KuaiRand lengths with group-shared negatives (~34 keys per token; 32
sequences of up to 4,096 tokens, ~0.6-0.9M keys a rank batch) it takes ~25-45 ms of one core instead of
1.5-5 s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# the key-by-sequence bitmap is used while it has at most this many cells (or 4 per key pair), else a sort
DENSE_CELLS = 1 << 24
# the greedy placement keeps which micro-batches hold a key as a bit pattern up to this many micro-batches
PATTERN_GROUPS = 12


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


@dataclass
class KeyIncidence:
    """Which sequences hold which keys, reduced to what the unique-key total of a partition depends on.

    ``single``: keys held by exactly one sequence (each adds 1 to the total of any partition). Row ``u``
    stands for a set of two or more sequences, and ``weight[u]`` for how many keys are held by exactly
    those; ``rows[i]``: the rows sequence ``i`` is in; ``holds[u, i]``: 1 if i is in row u.
    Weights are integers, so every sum of them below is exact."""

    num_seqs: int
    single: int
    weight: np.ndarray  # [U] float64
    holds: np.ndarray  # [U, num_seqs] 0/1, float32 (float64 if the weights total 2**24 or more)
    hw: np.ndarray  # [U, num_seqs] holds * weight, same dtype
    rows: list[np.ndarray]  # per sequence, sorted int64 indices into weight

    @classmethod
    def of(cls, key_sets: Sequence[np.ndarray]) -> KeyIncidence:
        m = len(key_sets)
        parts = [np.asarray(k).reshape(-1).astype(np.int64, copy=False) for k in key_sets]
        total = sum(p.size for p in parts)
        if total == 0:
            return cls._of_masks(m, 0, np.zeros((0, _words(m)), dtype=np.uint64))
        lo = min(int(p.min()) for p in parts if p.size)
        span = max(int(p.max()) for p in parts if p.size) - lo + 1
        if span * m <= max(DENSE_CELLS, 4 * total):
            present = np.zeros(span * m, dtype=bool)  # key-major bitmap: which sequences hold each key
            for i, p in enumerate(parts):
                present[(p - lo) * m + i] = True
            masks = _pack(present.reshape(span, m))
        else:
            keys = np.concatenate(parts)
            seq = np.repeat(np.arange(m, dtype=np.int64), [p.size for p in parts])
            shift = max(1, (m - 1).bit_length())
            if span >= 1 << (62 - shift):  # (key << shift) | seq would overflow: rank the keys first
                keys, lo = np.searchsorted(_sorted_unique(keys), keys), 0
            code = _sorted_unique(((keys - lo) << shift) | seq)  # distinct (key, sequence) pairs, by key
            key, seq = code >> shift, code & ((1 << shift) - 1)
            start = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            held = np.diff(np.r_[start, code.size])
            shared = held > 1
            single = int(np.count_nonzero(~shared))
            seq = seq[np.repeat(shared, held)]  # the holders of the shared keys, key by key
            start = np.r_[0, np.cumsum(held[shared])[:-1]] if shared.any() else held[:0]
            masks = np.zeros((start.size, _words(m)), dtype=np.uint64)
            if start.size:
                bit = np.left_shift(np.uint64(1), (seq & 63).astype(np.uint64))
                for w in range(masks.shape[1]):
                    masks[:, w] = np.bitwise_or.reduceat(np.where(seq >> 6 == w, bit, np.uint64(0)), start)
            return cls._of_masks(m, single, masks)
        held = np.bitwise_count(masks).sum(axis=1)
        return cls._of_masks(m, int(np.count_nonzero(held == 1)), masks[held > 1])

    @classmethod
    def _of_masks(cls, m: int, single: int, masks: np.ndarray) -> KeyIncidence:
        """From one holder bitmask [S, words] per shared key: merge equal masks (weight = how many keys)."""
        if masks.shape[0]:
            if masks.shape[1] == 1:
                flat = np.sort(masks[:, 0])
                new = np.r_[True, flat[1:] != flat[:-1]]
                masks = flat[new][:, None]
            else:
                masks = masks[np.lexsort(masks.T[::-1])]
                new = np.r_[True, (masks[1:] != masks[:-1]).any(axis=1)]
                masks = masks[new]
            weight = np.diff(np.r_[np.flatnonzero(new), new.size]).astype(np.float64)
        else:
            weight = np.zeros(0)
        bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1, bitorder="little")[:, :m]
        rows = [np.flatnonzero(b) for b in np.ascontiguousarray(bits.T).view(bool)]
        # float32 sums of integers are exact below 2**24, and no sum of weights exceeds their total
        holds = bits.astype(np.float32 if weight.sum() < 2**24 else np.float64)
        return cls(m, single, weight, holds, holds * weight[:, None].astype(holds.dtype), rows)

    def counts(self, groups: Sequence[Sequence[int]]) -> np.ndarray:
        """[U, len(groups)] how many sequences of each group are in each row."""
        onehot = np.zeros((self.num_seqs, len(groups)), dtype=self.holds.dtype)
        for g, members in enumerate(groups):
            onehot[list(members), g] = 1
        return (self.holds @ onehot).astype(np.int32)  # small integers: exact

    def total(self, cnt: np.ndarray) -> int:
        """Sum over the groups of their unique keys, from ``counts``."""
        return self.single + int(self.weight @ np.count_nonzero(cnt, axis=1))


def _words(m: int) -> int:
    return max(1, -(-m // 64))


def _pack(holders: np.ndarray) -> np.ndarray:
    """[K, m] bool -> [K, words] uint64 bitmasks (bit i: sequence i)."""
    packed = np.packbits(holders, axis=1, bitorder="little")
    packed = np.pad(packed, ((0, 0), (0, 8 * _words(holders.shape[1]) - packed.shape[1])))
    return np.ascontiguousarray(packed).view("<u8")


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    s = np.sort(a)
    return s[np.r_[True, s[1:] != s[:-1]]] if s.size else s


def cluster_by_keys(key_sets: Sequence[np.ndarray], token_counts: np.ndarray, n: int,
                    slack: float = 0.15) -> list[np.ndarray]:
    """Greedy key-centric clustering into ``n`` non-empty micro-batches of about equal tokens.

    Seeds are chosen farthest-first (the longest sequence, then each time the one sharing the fewest keys
    with the seeds so far). The other sequences are placed longest first; each goes to the micro-batch (with
    room left under ``(1 + slack) * tokens / n``) whose key set it overlaps most, ties to the lightest. A
    local search then moves sequences while that lowers the total of unique keys. The same local search is
    run from the contiguous split, and the better of the two is returned, so clustering never transfers more
    keys than the batch order does. Deterministic; the same partition as ``cluster_by_keys_reference``.
    """
    m = len(key_sets)
    n = max(1, min(n, m))
    counts = np.asarray(token_counts, dtype=np.float64)
    if n == 1:
        return [np.arange(m, dtype=np.int64)]
    cap = (1.0 + slack) * counts.sum() / n
    inc = KeyIncidence.of(key_sets)
    greedy = _greedy_fast(inc, counts, n, cap)
    plain = [g.tolist() for g in split_contiguous(counts, n)]
    totals = []
    for members in (greedy, plain):
        load = np.array([counts[g].sum() for g in members])
        cnt = inc.counts(members)
        _refine_fast(members, inc, cnt, counts, load, max(cap, float(load.max())))
        totals.append(inc.total(cnt))
    best = greedy if totals[0] <= totals[1] else plain
    return [np.array(sorted(g), dtype=np.int64) for g in best]


def _greedy_fast(inc: KeyIncidence, counts: np.ndarray, n: int, cap: float) -> list[list[int]]:
    """``_greedy`` on the incidence: a key only i holds is in no micro-batch yet, so i's overlaps need only
    its shared rows. Which micro-batches hold a row is kept as a bit pattern; i's overlaps are then the
    weight of its rows per pattern (one bincount) times the patterns' bits."""
    w, hw = inc.weight, inc.hw
    order = np.argsort(-counts, kind="stable")
    seeds = [int(order[0])]
    nearest = hw[inc.rows[seeds[0]]].sum(axis=0)  # keys shared with the seed (entry seed: its shared keys)
    while len(seeds) < n:
        free = order[~np.isin(order, seeds)]
        nxt = int(free[np.argmin(nearest[free])])  # the longest among the least overlapping
        seeds.append(nxt)
        nearest = np.maximum(nearest, hw[inc.rows[nxt]].sum(axis=0))
    members: list[list[int]] = [[s] for s in seeds]
    patterns = n <= PATTERN_GROUPS
    if patterns:
        held = np.zeros(w.size, dtype=np.uint16)  # bit c: micro-batch c holds the row
        pattern_bits = ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(np.float64)  # [2^n, n]
        for c, s in enumerate(seeds):
            held[inc.rows[s]] |= np.uint16(1 << c)
    else:
        cnt = inc.counts(members)
    load = counts[seeds].copy()
    seeded = set(seeds)
    for i in order.tolist():
        if i in seeded:
            continue
        r = inc.rows[i]
        if patterns:
            sub = held[r]
            ov = np.bincount(sub, weights=w[r], minlength=1 << n) @ pattern_bits  # i's keys each one holds
        else:
            sub = cnt[r]
            ov = w[r] @ (sub > 0)
        room = np.flatnonzero(load + counts[i] <= cap).tolist()
        cands = room or [int(np.argmin(load))]
        j = max(cands, key=lambda c: (ov[c], -load[c], -c))
        members[j].append(i)
        if patterns:
            held[r] = sub | np.uint16(1 << j)
        else:
            cnt[r, j] = sub[:, j] + 1
        load[j] += counts[i]
    return members


def _refine_fast(members: list[list[int]], inc: KeyIncidence, cnt: np.ndarray, counts: np.ndarray,
                 load: np.ndarray, cap: float, passes: int = 3) -> None:
    """``_refine`` on the incidence; updates ``members``, ``cnt`` and ``load``. Moving i from a to b frees
    the keys only i holds in a (``A1[i, a]``) and adds the keys of i that b lacks (``A0[i, b]``)."""
    where = np.empty(inc.num_seqs, dtype=np.int64)
    for j, g in enumerate(members):
        where[g] = j
    size = np.array([len(g) for g in members])
    hw = inc.hw
    a0, a1 = hw.T @ (cnt == 0), hw.T @ (cnt == 1)  # [m, n]
    for _ in range(passes):
        moved = False
        for i in range(inc.num_seqs):
            a = int(where[i])
            if size[a] == 1:
                continue
            gain = a1[i, a] - a0[i]
            ok = load + counts[i] <= cap
            ok[a] = False
            gain = np.where(ok, gain, 0.0)
            b = int(np.argmax(gain))  # the first best, as the reference's strict comparison
            if gain[b] <= 0:
                continue
            r = inc.rows[i]
            ca, cb = cnt[r, a], cnt[r, b]
            gone, last, new, second = (hw[r[ca == 1]].sum(axis=0), hw[r[ca == 2]].sum(axis=0),
                                       hw[r[cb == 0]].sum(axis=0), hw[r[cb == 1]].sum(axis=0))
            a0[:, a] += gone
            a1[:, a] += last - gone
            a0[:, b] -= new
            a1[:, b] += new - second
            cnt[r, a] = ca - 1
            cnt[r, b] = cb + 1
            members[a].remove(i)
            members[b].append(i)
            load[a] -= counts[i]
            load[b] += counts[i]
            size[a] -= 1
            size[b] += 1
            where[i] = b
            moved = True
        if not moved:
            break


def cluster_by_keys_reference(key_sets: Sequence[np.ndarray], token_counts: np.ndarray, n: int,
                              slack: float = 0.15) -> list[np.ndarray]:
    """``cluster_by_keys`` on Python sets: the original implementation, kept to check the vectorised one
    against and to measure it (quadratic in Python work per key; too slow at KuaiRand lengths)."""
    m = len(key_sets)
    n = max(1, min(n, m))
    counts = np.asarray(token_counts, dtype=np.float64)
    cap = (1.0 + slack) * counts.sum() / n
    sets = [set(np.asarray(k).reshape(-1).tolist()) for k in key_sets]
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


def unique_keys(groups: Sequence[np.ndarray], key_sets: Sequence[np.ndarray]) -> list[int]:
    """Deduplicated keys each micro-batch looks up."""
    out = []
    for g in groups:
        parts = [np.asarray(key_sets[i]).reshape(-1) for i in g]
        out.append(int(_sorted_unique(np.concatenate(parts)).size) if parts else 0)
    return out


def sequence_key_sets(offsets: np.ndarray, item_ids: np.ndarray, targets: np.ndarray, cands: np.ndarray | None,
                      negs: np.ndarray | None, per_set: int, perms: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The keys each sequence of a rank batch looks up: its items, targets, ranking candidates (row ``i`` of
    ``cands``) and the negative sets its tokens use (``negs``, one row per set of ``per_set`` consecutive
    tokens of the rank batch: their own sets and the sets they score through the logit-sharing ``perms``).
    ``negs`` is None when the batch shares one negative set (it is then in no micro-batch's unit)."""
    out = []
    for i in range(len(offsets) - 1):
        a, b = int(offsets[i]), int(offsets[i + 1])
        parts = [item_ids[a:b], targets[a:b]]
        if cands is not None:
            parts.append(cands[i])
        if negs is not None and b > a:
            own = np.arange(a // per_set, (b - 1) // per_set + 1)
            sets = _sorted_unique(np.concatenate([own, *(p[own] for p in perms)])) if len(perms) else own
            parts.append(negs[sets].reshape(-1))
        out.append(np.concatenate(parts))
    return out


def rank_key_inputs(schedule: Any, cfg: Any, num_items: int, epoch: int, step: int, global_step: int, rank: int,
                    ranking: bool) -> tuple[dict[str, Any], np.ndarray, int]:
    """What ``Preparer`` builds one rank batch's key sets from (the arguments of ``sequence_key_sets``), its
    history lengths and its micro-batch count: the same rows and the same draws (candidates, negatives,
    sharing permutations from the per-step generators)."""

    from grstack.runtime.train.batching import rank_batch
    from grstack.runtime.train.negatives import batch_negatives, share_permutations, step_generator

    rows_g = schedule.step_rows(epoch, step)
    parts = schedule.parts(rows_g)
    batch, _, cands, _ = rank_batch(schedule.split, rows_g[parts[rank]], cfg, num_items, ranking, global_step, rank)
    N, seed = batch.num_tokens, cfg.train.seed
    per_token = cfg.loss.sharing != "batch"
    per_set = 1 if cfg.loss.sharing == "token" else cfg.loss.group_size
    negs = batch_negatives(cfg.loss, num_items, -(-N // per_set), per_token,
                           step_generator(seed, "negatives", global_step, rank))
    perms = ([p.numpy() for p in share_permutations(negs.shape[0], cfg.negatives.share_k,
                                                    step_generator(seed, "share", global_step, rank))]
             if per_token and cfg.negatives.share_k > 1 else [])
    n_micro = min(cfg.pipeline.microbatches, min(len(p) for p in parts))
    inputs = {"offsets": batch.offsets.numpy(), "item_ids": batch.item_ids.numpy(),
              "targets": batch.targets.numpy(), "cands": cands.numpy() if cands is not None else None,
              "negs": negs.numpy() if per_token else None, "per_set": per_set, "perms": perms}
    return inputs, batch.lengths.numpy(), n_micro


def cluster_time_per_batch(schedule: Any, cfg: Any, num_items: int, *, rank: int = 0, steps: int = 5,
                           ranking: bool = True, epoch: int = 0) -> dict[str, Any]:
    """Host time the Preparer spends on clustering, per rank batch, over the first ``steps`` batches of an
    epoch (``cfg.pipeline.microbatches`` micro-batches; clustering is timed whatever ``pipeline.cluster``
    says). ``cluster_ms_per_batch`` is the median of building the key sets plus clustering them (both run
    in the prefetch thread); the parts, the keys per history token and the mean total of unique keys over
    the micro-batches (contiguous split vs clustered) come with it."""
    build, clus, keys_per_token, plain_keys, clustered_keys = [], [], [], [], []
    n_micro = 1
    for step in range(min(steps, schedule.steps_in_epoch(epoch))):
        inputs, lengths, n_micro = rank_key_inputs(schedule, cfg, num_items, epoch, step, step, rank, ranking)
        t0 = time.perf_counter()
        key_sets = sequence_key_sets(**inputs)
        t1 = time.perf_counter()
        groups = cluster_by_keys(key_sets, lengths, n_micro)
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        clus.append((t2 - t1) * 1e3)
        keys_per_token.append(sum(k.size for k in key_sets) / max(int(lengths.sum()), 1))
        plain_keys.append(sum(unique_keys(split_contiguous(lengths, n_micro), key_sets)))
        clustered_keys.append(sum(unique_keys(groups, key_sets)))
    total = [a + b for a, b in zip(build, clus, strict=True)]
    return {"cluster_ms_per_batch": float(np.median(total)) if total else 0.0,
            "key_sets_ms_per_batch": float(np.median(build)) if build else 0.0,
            "clustering_ms_per_batch": float(np.median(clus)) if clus else 0.0,
            "batches": len(total), "microbatches": n_micro,
            "keys_per_token": float(np.mean(keys_per_token)) if total else 0.0,
            "unique_keys_total": {"contiguous": float(np.mean(plain_keys)) if total else 0.0,
                                  "clustered": float(np.mean(clustered_keys)) if total else 0.0}}

"""Cheap negatives (docs/architecture.md §4.7): per-step generators, intra-batch logit sharing, host offload.

* Every random draw of a step (negatives, ranking candidates, logit-sharing shuffles) comes from a
  generator seeded by (seed, purpose, step, rank). A background thread can therefore prepare batches
  ahead of time and a resumed job draws exactly what the uninterrupted one drew, with no state to save.
* Negatives are shared by the whole batch (``loss.sharing=batch``), or drawn per set of ``loss.group_size``
  consecutive tokens of the rank's batch (``group``; ``token`` is groups of one). Sets belong to tokens, not
  to micro-batches, so splitting a batch into micro-batches does not change any token's negatives.
* Logit sharing (``negatives.share_k`` k): k-1 permutations of the rank batch's sets are drawn once per
  step; a token whose own set is s also scores sets perm_1[s], ..., perm_{k-1}[s], k·R negatives per token
  for the lookups of R. Micro-batches do not change this either: each micro-batch carries its tokens' own
  sets followed by the sets they score through sharing, with index maps local to the micro-batch.
* ``HostOffload`` keeps looked-up rows that wait for a later micro-batch in host memory (FP16 when asked)
  and reloads them one micro-batch ahead; on a CPU job host and device are the same memory, so it only
  applies the dtype. A slot is freed when it is taken.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from grstack.runtime.training_config import LossConfig

NEG_INF = -1e9
PURPOSES = {"negatives": 1, "candidates": 2, "share": 3}


def step_generator(seed: int, purpose: str, step: int, rank: int) -> torch.Generator:
    state = np.random.SeedSequence([seed, PURPOSES[purpose], step, rank]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def uniform_items(num_items: int, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Item ids in 1..num_items (0 is padding), the range every negative and candidate is drawn from."""
    return torch.randint(1, num_items + 1, shape, generator=generator)


def batch_negatives(loss: LossConfig, num_items: int, sets: int, per_token: bool,
                    generator: torch.Generator) -> torch.Tensor:
    """A rank batch's negative ids: [sets, R] (a set per token or group of tokens), [R] shared by the batch,
    or, with ``loss.full_softmax``, the whole catalogue 1..num_items (every step the same: nothing drawn)."""
    if loss.full_softmax:
        return torch.arange(1, num_items + 1)
    return uniform_items(num_items, (sets, loss.negatives) if per_token else (loss.negatives,), generator)


def share_permutations(n: int, k: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The k-1 logit-sharing permutations of a rank batch's n negative sets (drawn once per step)."""
    return [torch.randperm(n, generator=generator) for _ in range(k - 1)]


@dataclass(frozen=True)
class GroupLayout:
    """How tokens fall into negative sets, known on the host: per-set token counts (the sets a token uses,
    trailing unused sets dropped), and whether the sets are runs of ``max(counts)`` consecutive tokens.
    Computed from the host copy of ``group_of`` so the device never has to report it (each would be a sync)."""

    counts: torch.Tensor  # [G] int64, on the host
    k: int
    consecutive: bool

    @classmethod
    def of(cls, group_of: torch.Tensor) -> GroupLayout:
        g = group_of.cpu()
        counts = torch.bincount(g)  # length max(group_of) + 1: the trailing sets no token uses drop out
        n = g.numel()
        k = int(counts.max()) if n else 0
        consecutive = bool(n) and -(-n // k) == counts.numel() and torch.equal(g, torch.arange(n) // k)
        return cls(counts=counts, k=k, consecutive=consecutive)


def grouped_logits(query: torch.Tensor, neg: torch.Tensor, group_of: torch.Tensor,
                   layout: GroupLayout | None = None) -> torch.Tensor:
    """[N, R] scores of every token against its group's negatives (neg [G, R, d]; group_of [N] in 0..G-1),
    as one batched matmul over groups padded to the largest group (no [N, R, d] gather). Sets after the
    last one a token uses are not computed (a micro-batch's sets scored only through sharing come last).
    ``layout``: ``GroupLayout.of(group_of)`` computed on the host (else it is computed here, which on an
    accelerator reads ``group_of`` back)."""
    layout = layout if layout is not None else GroupLayout.of(group_of)
    n, d = query.shape
    R = neg.shape[1]
    G, k = layout.counts.numel(), layout.k
    neg = neg[:G]
    at = torch.arange(n, device=query.device)
    if layout.consecutive:
        # consecutive sets of k tokens (the last may be shorter): a reshape, no gather or scatter
        padded = F.pad(query, (0, 0, 0, G * k - n))
        return torch.bmm(padded.view(G, k, d), neg.transpose(1, 2)).view(G * k, R)[:n]
    counts = layout.counts.to(query.device, non_blocking=True)
    order = torch.argsort(group_of, stable=True)
    g_sorted = group_of.index_select(0, order)
    starts = torch.cumsum(counts, 0) - counts
    flat = g_sorted * k + (at - starts.index_select(0, g_sorted))  # row of each sorted token in [G * k]
    # index_select / index_copy (not advanced indexing): their backward passes are cheap gathers and adds
    padded = query.new_zeros((G * k, d)).index_copy(0, flat, query.index_select(0, order))
    scores = torch.bmm(padded.view(G, k, d), neg.transpose(1, 2)).view(G * k, R)
    where = torch.empty_like(order).index_copy_(0, order, flat)  # row of token i in [G * k]
    return scores.index_select(0, where)


def sampled_softmax_sum(query: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, targets: torch.Tensor,
                        neg_ids: torch.Tensor, temperature: float, group_of: torch.Tensor | None = None,
                        share: list[torch.Tensor] | None = None, layout: GroupLayout | None = None
                        ) -> torch.Tensor:
    """Sum over tokens of InfoNCE (summed, not averaged: the engine divides by the global token count).

    neg: [R, d] shared by all tokens, or [G, R, d] with ``group_of`` [N] naming each token's set (one set per
    token or per group of tokens). ``share`` (intra-batch logit sharing): index arrays into the G sets, each
    with one entry per set a token may own (every ``group_of[i]`` < ``len(perm)`` <= G); token i also scores
    the negatives of set ``perm[group_of[i]]``. Over a whole rank batch they are permutations of the sets; a
    micro-batch lists its tokens' own sets first and the sets they score only through sharing after them,
    and its maps are the batch permutations restricted to its own sets. Negatives equal to the target are
    masked. ``layout``: ``GroupLayout.of(group_of)`` from the host (see ``grouped_logits``).
    """
    pos_logit = (query * pos).sum(-1, keepdim=True)
    if neg.dim() == 2:
        neg_logits = query @ neg.t()
        blocks = [neg_logits.masked_fill(neg_ids[None, :] == targets[:, None], NEG_INF)]
    else:
        assert group_of is not None
        layout = layout if layout is not None else GroupLayout.of(group_of)
        blocks = []
        for perm in [None, *(share or [])]:
            ids = neg_ids if perm is None else neg_ids[perm]
            vecs = neg if perm is None else neg[perm]
            logits = grouped_logits(query, vecs, group_of, layout)
            blocks.append(logits.masked_fill(ids[group_of] == targets[:, None], NEG_INF))
    logits = torch.cat([pos_logit, *blocks], dim=1) / temperature
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).sum()


class HostOffload:
    """Rows parked in host memory until their micro-batch; ``prefetch`` starts the reload of the next.

    ``park(rows, half=True)`` stores negative-only rows in FP16; positives are parked at full precision.
    ``park`` returns a new slot number (never reused); ``take(slot)`` hands the rows back and frees the slot,
    so what is held is only what was parked and not yet taken (one batch's rows in a semi-async step).
    ``discard`` frees slots that will never be taken (a prefetched batch that is dropped).
    """

    def __init__(self, device: torch.device, fp16: bool) -> None:
        self.device = device
        self.fp16 = fp16
        self.parked: dict[int, torch.Tensor] = {}  # slot -> rows in host memory, until taken
        self.loaded: dict[int, torch.Tensor] = {}  # slot -> rows on the device (prefetched), until taken
        self._next = 0
        self._lock = threading.Lock()  # park runs in the issuing thread, take in the main thread

    def park(self, rows: torch.Tensor, half: bool = False) -> int:
        """On an accelerator the device-to-host copy is asynchronous (into pinned memory, on the caller's
        stream): whoever takes the slot orders its stream after the caller's first (a marker), never the
        host, which does not read the rows."""
        host = rows.to(torch.float16) if half and self.fp16 else rows
        if self.device.type != "cpu":
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            host = pinned.copy_(host, non_blocking=True)
        with self._lock:
            slot = self._next
            self._next += 1
            self.parked[slot] = host
        return slot

    def prefetch(self, slot: int) -> None:
        with self._lock:
            host = self.parked.get(slot)
            if host is None or slot in self.loaded:
                return
            # the host copy stays parked until take: a non-blocking copy may still be reading it
            self.loaded[slot] = host.to(self.device, non_blocking=True)

    def take(self, slot: int) -> torch.Tensor:
        self.prefetch(slot)
        with self._lock:
            rows = self.loaded.pop(slot)
            del self.parked[slot]
        return rows.float() if rows.dtype != torch.float32 else rows

    def discard(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self.parked.pop(slot, None)
                self.loaded.pop(slot, None)

    @property
    def held(self) -> int:
        """Slots parked and not yet taken or discarded."""
        with self._lock:
            return len(self.parked)

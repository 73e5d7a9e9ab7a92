"""What each rank trains on at each global step, prepared ahead by a background thread.

``Schedule`` is a pure function of (seed, epoch, lengths): the epoch order, its cut into global batches
(count or token budget), and the split of each global batch across ranks (token balancing). ``Preparer``
turns a rank's part into frozen-window micro-batches (contiguous or key-clustered), draws negatives, ranking
candidates and logit-sharing permutations from per-step generators, and dedupes the ids of every lookup
unit. ``BatchStream`` runs ``Preparer`` in a thread, a bounded number of steps ahead: stage 1 (data
prefetch) of the pipeline.

Every draw is made once per rank batch, before it is cut into micro-batches, so the cut does not change
what any token scores: its negative set (sets belong to tokens: ``loss.group_size`` consecutive tokens of
the rank batch, or one token), the sets it scores through logit sharing (``negatives.share_k``: k-1
permutations of all of the rank's sets), and its ranking candidates. A micro-batch carries the sets its
tokens own and, after them, the sets they score only through sharing, all in its lookup unit; with N=1 the
micro-batch's sets, groups and sharing permutations are exactly the rank batch's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from grstack.runtime.data import JaggedBatch, LeaveOneOut, append_candidates, exposure_labels, ranges_index
from grstack.runtime.device import set_current_device
from grstack.runtime.embedding import LookupUnit, make_unit
from grstack.runtime.errors import UserError
from grstack.runtime.model import ItemFeatureMap, UserContextLayout, batch_keys
from grstack.runtime.train import balance, microbatching
from grstack.runtime.train.negatives import (
    GroupLayout,
    batch_negatives,
    share_permutations,
    step_generator,
    uniform_items,
)
from grstack.runtime.training_config import Config


@dataclass
class MicroBatch:
    full: JaggedBatch  # history tokens (+ M candidate tokens per sequence when the ranking head trains)
    is_hist: torch.Tensor | None  # [sum_L'] history mask when candidates are appended
    targets: torch.Tensor  # [N] next item of every history token
    cand_ids: torch.Tensor | None  # [B, M]
    labels: torch.Tensor | None  # [B, M, T]
    # sharing group/token: the G negative sets this micro-batch's tokens score, the Gown sets its tokens own
    # first (in rank-batch order), then the sets they score only through logit sharing (in rank-batch order)
    neg_ids: torch.Tensor | None  # [G, R]
    neg_group: torch.Tensor | None  # [N] each token's own set, in 0..Gown-1
    unit: int  # index of this micro-batch's lookup unit in PreparedBatch.units
    inv_input: torch.Tensor  # index in the unit's keys of every table row the input reads (model.lookup_keys)
    inv_target: torch.Tensor  # [N]
    inv_neg: torch.Tensor | None  # [G, R]
    # logit sharing: k-1 maps [Gown] -> 0..G-1, the step's permutations restricted to this micro-batch's own
    # sets (token i also scores set perm[neg_group[i]]); with one micro-batch they are the permutations
    share: list[torch.Tensor] = field(default_factory=list)
    num_seqs: int = 0
    num_tokens: int = 0
    # host facts the device would otherwise have to report (each a sync): how tokens fall into negative
    # sets, and where the history and candidate tokens are
    neg_layout: GroupLayout | None = None
    hist_index: torch.Tensor | None = None  # [N] positions of history tokens in ``full``
    cand_index: torch.Tensor | None = None  # [B * M] positions of candidate tokens


@dataclass
class PreparedBatch:
    epoch: int
    step_in_epoch: int
    global_step: int
    micro: list[MicroBatch]
    units: list[LookupUnit]
    neg_unit: int | None  # the unit of the batch's shared negatives (loss.sharing=batch)
    batch_neg_ids: torch.Tensor | None  # [R]
    inv_batch_neg: torch.Tensor | None  # [R]
    global_seqs: int
    global_tokens: int
    global_cands: int
    local_seqs: int
    local_tokens: int
    rank_costs: np.ndarray  # per-rank cost under the split used
    count_costs: np.ndarray  # per-rank cost had every rank taken an equal count (the baseline)
    mb_unique_keys: list[int] = field(default_factory=list)


def pins_batches(device: torch.device) -> bool:
    """Whether batches bound for ``device`` are pinned: the step copies them with ``non_blocking=True``,
    which from pageable host memory is staged by the driver and does not overlap; on CPU nothing is copied
    (and pinning needs an accelerator)."""
    return device.type in ("cuda", "npu")


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index: the current one of this (the main) thread when it names none."""
    if device.index is not None:
        return device
    backend = torch.cuda if device.type == "cuda" else torch.npu  # type: ignore[attr-defined]  # torch_npu
    return torch.device(device.type, backend.current_device())


def _pinned(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.pin_memory() if t is not None else None


def pin_batch(batch: PreparedBatch) -> PreparedBatch:
    """``batch`` with the host tensors the step moves to the device (``Engine._forward``'s ``_dev`` and
    ``full.to``) in pinned memory; routing keys (the lookup units) stay where they are."""
    micro = []
    for mb in batch.micro:
        full = mb.full.pin_memory()
        micro.append(replace(
            mb, full=full, targets=full.targets if mb.targets is mb.full.targets else mb.targets.pin_memory(),
            cand_ids=_pinned(mb.cand_ids), labels=_pinned(mb.labels), neg_ids=_pinned(mb.neg_ids),
            neg_group=_pinned(mb.neg_group), inv_input=mb.inv_input.pin_memory(),
            inv_target=mb.inv_target.pin_memory(), inv_neg=_pinned(mb.inv_neg),
            share=[p.pin_memory() for p in mb.share], hist_index=_pinned(mb.hist_index),
            cand_index=_pinned(mb.cand_index)))
    return replace(batch, micro=micro, batch_neg_ids=_pinned(batch.batch_neg_ids),
                   inv_batch_neg=_pinned(batch.inv_batch_neg))


class Schedule:
    def __init__(self, split: LeaveOneOut, cfg: Config, world_size: int, ranking_candidates: int) -> None:
        self.split, self.cfg, self.world_size = split, cfg, world_size
        self.extra_tokens = ranking_candidates  # candidate tokens per sequence (0 without the ranking head)
        self.lengths = split.train_lengths(cfg.data.max_len)  # history tokens per training row
        # the split's cost weights: the config's until the trainer sets calibrated / profiled / checkpointed
        # ones (set_weights, before any batch is prepared)
        self.cost_a, self.cost_b = cfg.balance.cost_a, cfg.balance.cost_b
        self._cache: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self._steps: dict[int, int] = {}
        self._lock = threading.Lock()

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.split.train_users))

    def epoch(self, epoch: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """The epoch's order and its global batches (positions into the order); the last epoch is cached."""
        with self._lock:
            if epoch not in self._cache:
                order = self.order(epoch)
                b = self.cfg.balance
                batches = balance.global_batches(self.lengths[order], self.world_size,
                                                 self.cfg.train.batch_size, b.token_budget)
                self._cache = {epoch: (order, batches)}
                self._steps[epoch] = len(batches)
            return self._cache[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self._steps:
            self.epoch(epoch)
        return self._steps[epoch]

    def total_steps(self) -> int:
        t = self.cfg.train
        total = sum(self.steps_in_epoch(e) for e in range(t.epochs))
        return min(total, t.max_steps) if t.max_steps else total

    def step_rows(self, epoch: int, step: int) -> np.ndarray:
        order, batches = self.epoch(epoch)
        return order[batches[step]]

    def own_rows(self) -> np.ndarray:
        """The rows this rank can build batches of (every row: each rank holds the whole dataset)."""
        return np.arange(len(self.lengths))

    def set_weights(self, a: float, b: float) -> None:
        """The cost weights of every later split (cost a·L + b·L² per sequence of L tokens)."""
        self.cost_a, self.cost_b = float(a), float(b)

    def parts(self, rows: np.ndarray, mode: str | None = None) -> list[np.ndarray]:
        return balance.assign(self.lengths[rows] + self.extra_tokens, self.world_size,
                              mode or self.cfg.balance.mode, self.cost_a, self.cost_b)

    def costs(self, rows: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
        return balance.rank_costs(self.lengths[rows] + self.extra_tokens, parts, self.cost_a, self.cost_b)

    def positions(self, start_epoch: int, start_step: int, global_step: int) -> Iterator[tuple[int, int, int]]:
        """(epoch, step_in_epoch, global_step) from a resume point to the end of training."""
        total = self.total_steps()
        e, s, g = start_epoch, start_step, global_step
        while e < self.cfg.train.epochs and g < total:
            if s >= self.steps_in_epoch(e):
                e, s = e + 1, 0
                continue
            yield e, s, g
            s, g = s + 1, g + 1


def _slice(batch: JaggedBatch, target_ts: torch.Tensor, seqs: np.ndarray) -> tuple[JaggedBatch, torch.Tensor,
                                                                                   np.ndarray]:
    off = batch.offsets.numpy()
    idx, offsets = ranges_index(off[:-1][seqs], off[1:][seqs])
    t = torch.from_numpy(idx)
    sub = JaggedBatch(item_ids=batch.item_ids[t], offsets=torch.from_numpy(offsets),
                      timestamps=batch.timestamps[t], targets=batch.targets[t],
                      actions=batch.actions[t] if batch.actions is not None else None,
                      user_index=batch.user_index[torch.from_numpy(seqs)] if batch.user_index is not None else None,
                      input_actions=batch.input_actions[t] if batch.input_actions is not None else None,
                      context=batch.context[torch.from_numpy(seqs)] if batch.context is not None else None)
    return sub, target_ts[t], idx


def rank_batch(split: Any, rows: np.ndarray, cfg: Config, num_items: int, ranking: bool, step: int, rank: int
               ) -> tuple[JaggedBatch, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A rank's training batch of ``rows`` of ``split`` (a LeaveOneOut, or a rank's share of one): the history
    batch, its targets' timestamps, and with ``ranking`` the candidates [B, M] and, for logged exposures
    (``loss.ranking_on=exposures``), their action bits [B, M] (else None).

    Exposures: each user's training block is drawn anew every step (``block_backs``, from the step's
    generator) and the history stops before it; otherwise each sequence's last target (the logged next
    event) then ``M - 1`` uniform items of the step's generator."""
    M, seed = cfg.loss.ranking_candidates, cfg.train.seed
    if ranking and cfg.loss.ranking_on == "exposures":
        g = step_generator(seed, "candidates", step, rank)
        back = split.block_backs(rows, torch.rand(len(rows), generator=g, dtype=torch.float64).numpy())
        batch, target_ts = split.train_batch(rows, cfg.data.max_len, back)
        cands, acts = split.train_block(rows, back)
        return batch, target_ts, cands, acts
    batch, target_ts = split.train_batch(rows, cfg.data.max_len)
    if not ranking:
        return batch, target_ts, None, None
    g = step_generator(seed, "candidates", step, rank)
    last = batch.offsets[1:] - 1
    cands = torch.cat([batch.targets[last][:, None], uniform_items(num_items, (batch.batch_size, M - 1), g)], dim=1)
    return batch, target_ts, cands, None


class Preparer:
    """Builds one rank's PreparedBatch for a global step."""

    def __init__(self, schedule: Schedule, cfg: Config, rank: int, num_items: int, num_tasks: int,
                 ranking: bool, item_features: ItemFeatureMap | None = None,
                 context_layout: UserContextLayout | None = None) -> None:
        self.s, self.cfg, self.rank = schedule, cfg, rank
        self.num_items, self.num_tasks, self.ranking = num_items, num_tasks, ranking
        # ranking on blocks of logged exposures (loss.ranking_on=exposures) instead of next-vs-uniform sets
        self.exposures = ranking and cfg.loss.ranking_on == "exposures"
        if self.exposures and num_tasks < 2:
            raise UserError("loss.ranking_on=exposures trains the ranking head on logged actions (click, like, "
                            "...): this dataset has none")
        # side features and user context: an input token reads its item row and its feature rows, a sequence
        # its context rows (one lookup with the rest)
        self.item_features, self.context_layout = item_features, context_layout

    def __call__(self, epoch: int, step: int, global_step: int) -> PreparedBatch:
        cfg, s = self.cfg, self.s
        rows_g = s.step_rows(epoch, step)
        parts = s.parts(rows_g)
        mine = rows_g[parts[self.rank]]
        batch, target_ts, cands, cand_acts = rank_batch(s.split, mine, cfg, self.num_items, self.ranking,
                                                        global_step, self.rank)
        B, N = batch.batch_size, batch.num_tokens
        M = cfg.loss.ranking_candidates
        seed = cfg.train.seed
        per_token = cfg.loss.sharing != "batch"
        per_set = 1 if cfg.loss.sharing == "token" else cfg.loss.group_size
        g = step_generator(seed, "negatives", global_step, self.rank)
        negs = batch_negatives(cfg.loss, self.num_items, -(-N // per_set), per_token, g)
        # logit sharing: drawn once over all of the rank's sets, so micro-batching does not change it
        perms = ([p.numpy() for p in share_permutations(negs.shape[0], cfg.negatives.share_k,
                                                        step_generator(seed, "share", global_step, self.rank))]
                 if per_token and cfg.negatives.share_k > 1 else [])
        lengths = batch.lengths.numpy()
        n_micro = min(cfg.pipeline.microbatches, min(len(p) for p in parts))
        if cfg.pipeline.cluster and n_micro > 1:
            # a sequence's keys: its items, targets, candidates and the negative sets its tokens use (their
            # own sets and the sets they score through logit sharing)
            key_sets = microbatching.sequence_key_sets(
                batch.offsets.numpy(), batch.item_ids.numpy(), batch.targets.numpy(),
                cands.numpy() if cands is not None else None, negs.numpy() if per_token else None, per_set, perms)
            groups = microbatching.cluster_by_keys(key_sets, lengths, n_micro)
        else:
            groups = microbatching.split_contiguous(lengths, n_micro)
        fp16 = cfg.negatives.fp16
        units: list[LookupUnit] = []
        neg_unit = inv_batch_neg = None
        if not per_token:
            unit, inv_f, inv_h = make_unit(negs[:0], negs) if fp16 else make_unit(negs)
            inv_batch_neg = inv_h if fp16 else inv_f
            neg_unit = 0
            units.append(unit)
        where = np.full(negs.shape[0] if per_token else 0, -1, np.int64)  # rank set -> micro-batch set
        micro = []
        for grp in groups:
            sub, sub_ts, tok = _slice(batch, target_ts, grp)
            mb_cands = cands[torch.from_numpy(grp)] if cands is not None else None
            labels = is_hist = None
            full = sub
            if mb_cands is not None:
                last = sub.offsets[1:] - 1
                # the candidates' request time: the last input's target (the block's first event, with blocks)
                full, is_hist = append_candidates(sub, mb_cands, sub_ts[last])
                if cand_acts is not None:  # logged exposures: each candidate's own action bits
                    labels = torch.from_numpy(exposure_labels(cand_acts[torch.from_numpy(grp)].numpy(),
                                                              self.num_tasks))
                else:  # the logged next event (its actions), then uniform items (0 for every task)
                    labels = torch.zeros(sub.batch_size, M, self.num_tasks)
                    labels[:, 0, 0] = 1.0
                    if sub.actions is not None:
                        bits = sub.actions[last]
                        for t in range(1, self.num_tasks):
                            labels[:, 0, t] = ((bits >> (t - 1)) & 1).float()
            input_keys = batch_keys(self.item_features, self.context_layout, full.item_ids, full.context)
            n_in = input_keys.numel()
            mb_negs = neg_group = None
            share: list[torch.Tensor] = []
            if per_token:
                own, local = np.unique(tok // per_set, return_inverse=True)
                # the sets these tokens score through sharing, after their own (a micro-batch's lookup unit
                # must hold every set its tokens score)
                extra = np.setdiff1d(np.concatenate([p[own] for p in perms]), own) if perms else own[:0]
                sets = np.concatenate([own, extra])
                where[sets] = np.arange(len(sets))
                share = [torch.from_numpy(where[p[own]]) for p in perms]
                where[sets] = -1
                mb_negs, neg_group = negs[torch.from_numpy(sets)], torch.from_numpy(local.reshape(-1))
            full_ids = torch.cat([input_keys, sub.targets])
            if mb_negs is None:
                unit, inv_f, _ = make_unit(full_ids)
                inv_neg = None
            elif fp16:
                unit, inv_f, inv_neg = make_unit(full_ids, mb_negs.reshape(-1))
            else:
                unit, inv_all, _ = make_unit(torch.cat([full_ids, mb_negs.reshape(-1)]))
                inv_f, inv_neg = inv_all[: full_ids.numel()], inv_all[full_ids.numel():]
            micro.append(MicroBatch(
                full=full, is_hist=is_hist, targets=sub.targets, cand_ids=mb_cands, labels=labels,
                neg_ids=mb_negs, neg_group=neg_group, unit=len(units), inv_input=inv_f[:n_in],
                inv_target=inv_f[n_in:], inv_neg=inv_neg.reshape(mb_negs.shape) if inv_neg is not None else None,
                share=share, num_seqs=sub.batch_size, num_tokens=sub.num_tokens,
                neg_layout=GroupLayout.of(neg_group) if neg_group is not None else None,
                hist_index=torch.nonzero(is_hist).squeeze(1) if is_hist is not None else None,
                cand_index=torch.nonzero(~is_hist).squeeze(1) if is_hist is not None else None))
            units.append(unit)
        tokens_g = int(s.lengths[rows_g].sum())
        return PreparedBatch(
            epoch=epoch, step_in_epoch=step, global_step=global_step, micro=micro, units=units,
            neg_unit=neg_unit, batch_neg_ids=None if per_token else negs, inv_batch_neg=inv_batch_neg,
            global_seqs=len(rows_g), global_tokens=tokens_g, global_cands=len(rows_g) * M if self.ranking else 0,
            local_seqs=B, local_tokens=N, rank_costs=s.costs(rows_g, parts),
            count_costs=s.costs(rows_g, s.parts(rows_g, "count")),
            mb_unique_keys=[units[m.unit].num_keys for m in micro])


class BatchStream:
    """Prepared batches in order, produced ``depth`` steps ahead by a daemon thread (or inline); for an
    accelerator ``device`` their host tensors are pinned there (``pin_batch``)."""

    _END = object()

    def __init__(self, positions: Iterator[tuple[int, int, int]], prepare: Preparer, depth: int,
                 background: bool, device: torch.device | None = None) -> None:
        self._positions, self._prepare = positions, prepare
        # batches for an accelerator are pinned where they are prepared (the background thread)
        self._pin = device is not None and pins_batches(device)
        self._device = _indexed(device) if device is not None and self._pin else None
        self._ahead: list[PreparedBatch] = []
        self._done = False
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if background:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._produce, name="grstack-batches", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        assert self._queue is not None
        try:
            if self._device is not None:  # else pinning makes a context on device 0 (as DataLoader's pin thread)
                set_current_device(self._device)
            for pos in self._positions:
                item = self._prepared(pos)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._END)
        except BaseException as exc:  # handed to the consumer
            self._queue.put(exc)

    def _prepared(self, pos: tuple[int, int, int]) -> PreparedBatch:
        batch = self._prepare(*pos)
        return pin_batch(batch) if self._pin else batch

    def _fetch(self) -> PreparedBatch | None:
        if self._done:
            return None
        if self._queue is None:
            pos = next(self._positions, None)
            if pos is None:
                self._done = True
                return None
            return self._prepared(pos)
        item = self._queue.get()
        if item is self._END:
            self._done = True
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def peek(self) -> PreparedBatch | None:
        if not self._ahead:
            item = self._fetch()
            if item is None:
                return None
            self._ahead.append(item)
        return self._ahead[0]

    def next(self) -> PreparedBatch | None:
        if self._ahead:
            return self._ahead.pop(0)
        return self._fetch()

    def close(self) -> None:
        self._stop.set()

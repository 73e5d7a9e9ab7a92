"""Evaluation of the ranking head on held-out events (docs/training.md, "Evaluation"; docs/features.md).

``ranking_on=exposures`` (HSTU's ranking): each evaluated user's held-out block of ``k`` logged exposures
(``LeaveOneOut.eval_block``) sits after the history before it, every candidate at the block's first event's
time (the request time), and each is labelled with its own action bits; task 0 ("next") is 1 for every
logged event and is not reported. The rest of this note is ``ranking_on=uniform``.

Each evaluated user gets one candidate set shaped like training's (``train/batching.py``): candidate 0 is
the split's target, the other ``M - 1`` are items drawn uniformly from 1..num_items, history not excluded
(training does not exclude it either, so a negative may even be the target item). Labels are training's:
task 0 is "is the target", task t >= 1 is the target event's action bit t - 1, negatives are 0 everywhere.
The candidates sit after the user's history at the target's timestamp, as in training, and are scored by
the model's ranking path (``encode`` then ``rank_logits``).

The negatives are a counter-based hash of (seed, split, user id, slot), not a stream: a user's set does not
depend on batching, on which rank evaluates the user or on who else is evaluated, so the trainer's sharded
evaluation and ``grstack eval`` on the export score the same sets.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from grstack.runtime.data import LeaveOneOut, append_candidates, exposure_labels
from grstack.runtime.eval.ranking import ranking_report

_SPLIT_CODE = {"valid": 1, "test": 2}
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps, which is the point)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def eval_candidates(seed: int, which: str, user_ids: np.ndarray, targets: np.ndarray, num_items: int,
                    num_candidates: int) -> np.ndarray:
    """[B, M] candidate ids: each user's target first, then ``M - 1`` uniform items in 1..num_items, a
    function of (seed, which, user id, slot) alone."""
    if num_items < 1:
        raise ValueError(f"num_items must be positive, got {num_items}")
    users = np.asarray(user_ids, dtype=np.int64).astype(np.uint64)[:, None]
    slots = np.arange(1, num_candidates, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        key = _mix(np.full(1, np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) + _GOLDEN * np.uint64(_SPLIT_CODE[which]))
        h = _mix(_mix(key + _GOLDEN * (users + np.uint64(1))) + _GOLDEN * slots)
    negatives = (h % np.uint64(num_items)).astype(np.int64) + 1
    return np.concatenate([np.asarray(targets, dtype=np.int64)[:, None], negatives], axis=1)


def candidate_labels(num_users: int, num_candidates: int, num_tasks: int,
                     target_actions: np.ndarray | None) -> np.ndarray:
    """[B, M, T] labels as training builds them: candidate 0 is positive for task 0 and carries the target's
    action bit t - 1 for task t; every other candidate is 0."""
    labels = np.zeros((num_users, num_candidates, num_tasks), dtype=np.float32)
    labels[:, 0, 0] = 1.0
    if target_actions is not None:
        bits = np.asarray(target_actions, dtype=np.int64)
        for t in range(1, num_tasks):
            labels[:, 0, t] = (bits >> (t - 1)) & 1
    return labels


@torch.no_grad()
def rank_head_logits(model: nn.Module, split: LeaveOneOut, which: str, rows: np.ndarray, *, max_len: int,
                     batch_size: int, device: torch.device, num_candidates: int, seed: int,
                     num_items: int | None = None, lookup: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     rounds: int | None = None, tick: Callable[[], None] | None = None,
                     ranking_on: str = "uniform") -> tuple[np.ndarray, np.ndarray]:
    """Labels and ranking-head logits, both [B, M, T], of the users at ``rows`` (``ranking_on``: module doc;
    with ``exposures`` M is the split's block).

    ``num_items``: the catalogue negatives are drawn from (default the split's; a split of a few pieces of a
    larger dataset does not know it). ``lookup``: item rows of host ids from elsewhere (the trainer's sharded
    table; a collective, so it is called once per round even without users); ``rounds``: the number of
    batches to run (at least this rank's; every member of a sparse group must run as many)."""
    num_items = split.ds.num_items if num_items is None else num_items
    T = int(model.num_tasks)
    M = num_candidates
    if ranking_on not in ("uniform", "exposures"):
        raise ValueError(f"ranking_on must be uniform or exposures, got {ranking_on!r}")
    if ranking_on == "exposures" and split.block != M:
        raise ValueError(f"the split's ranking block ({split.block}) is not num_candidates ({M})")
    was_training = model.training
    model.eval()
    ids_ds = split.ds.user_ids[split.users[rows]]
    n_rounds = max(-(-len(rows) // batch_size), rounds or 0)
    labels_out, logits_out = [], []
    for r in range(n_rounds):
        chunk = rows[r * batch_size : (r + 1) * batch_size]
        if not len(chunk):
            if lookup is not None:
                lookup(torch.zeros(0, dtype=torch.int64))
            continue
        if ranking_on == "exposures":
            batch, block_ids, block_ts, block_acts = split.eval_block(which, chunk, max_len)
            cands = block_ids.numpy()
            labels = exposure_labels(block_acts.numpy() if block_acts is not None else None, T)
            full, is_hist = append_candidates(batch, block_ids, block_ts)
        else:
            batch, targets = split.eval_batch(which, chunk, max_len)
            _, target_ts, actions = split.eval_targets(which, chunk)
            cands = eval_candidates(seed, which, ids_ds[r * batch_size : (r + 1) * batch_size], targets.numpy(),
                                    num_items, M)
            labels = candidate_labels(len(chunk), M, T, actions)
            full, is_hist = append_candidates(batch, torch.from_numpy(cands), torch.from_numpy(target_ts))
        cand_at = torch.nonzero(~is_hist).squeeze(1)
        rows_in = ctx_in = None
        if lookup is not None:
            rows_in, ctx_in = model.looked_rows(full, lookup(model.lookup_keys(full)).to(device))
        full = full.to(device)
        out = model.encode(full, item_rows=rows_in, **({"context_rows": ctx_in} if ctx_in is not None else {}))
        cand_at = cand_at.to(device)
        logits = model.rank_logits(out.index_select(0, cand_at), torch.from_numpy(cands).reshape(-1).to(device),
                                   cand_rows=rows_in.index_select(0, cand_at) if rows_in is not None else None)
        logits_out.append(logits.float().reshape(len(chunk), M, T).cpu().numpy())
        labels_out.append(labels)
        if tick is not None:
            tick()
    model.train(was_training)
    if not logits_out:
        empty = np.zeros((0, M, T), dtype=np.float32)
        return empty, empty.copy()
    return np.concatenate(labels_out), np.concatenate(logits_out)


def has_trained_rank_head(model: nn.Module, ranking_weight: float) -> str | None:
    """None when the model's ranking head was trained, else why the ranking metrics are not computed."""
    if getattr(model, "rank_head", None) is None:
        return "the model has no ranking head"
    if ranking_weight <= 0:
        return "loss.ranking_weight is 0: the ranking head was not trained"
    return None


def evaluate_ranking(model: nn.Module, split: LeaveOneOut, which: str, tasks: list[str], *, max_len: int,
                     num_candidates: int, seed: int, batch_size: int = 512, device: torch.device | None = None,
                     max_users: int | None = None, ranking_on: str = "uniform") -> dict[str, dict[str, object]]:
    """Per task: AUC, GAUC, NE, impressions and positives of the ranking head on the ``which`` targets (the
    users :func:`grstack.runtime.eval.evaluate.evaluate` ranks, ``max_users`` chosen alike), or on their
    held-out blocks of logged exposures (``ranking_on=exposures``)."""
    rows = np.arange(split.num_users)
    if max_users is not None and max_users < len(rows):
        rows = np.sort(np.random.default_rng(0).choice(rows, size=max_users, replace=False))
    labels, logits = rank_head_logits(model, split, which, rows, max_len=max_len, batch_size=batch_size,
                                      device=device or torch.device("cpu"), num_candidates=num_candidates,
                                      seed=seed, ranking_on=ranking_on)
    return ranking_report(labels, logits, tasks, ranking_on)

"""Leave-one-out full-ranking evaluation: the target against all items, the user's earlier items excluded."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from grstack.runtime.data import LeaveOneOut
from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks


def last_token_outputs(outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return outputs[offsets[1:] - 1]


# Below this many rows on either side a BLAS may take another path (a matrix-vector product, a transposed
# kernel) whose sums round differently; score_items pads up to it so every score is the same dot product
# whatever the shapes around it (sharded evaluation scores a shard's rows for many ranks' users at once).
MIN_GEMM_ROWS = 16


def score_items(queries: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """``queries @ items.t()`` ([M, N]), each score computed the same way whatever M, N and the row's place:
    both sides are zero-padded to at least :data:`MIN_GEMM_ROWS` rows (checked on CPU BLAS, where smaller
    shapes take other kernels; an accelerator's BLAS may still pick kernels by shape)."""
    m, n = queries.shape[0], items.shape[0]
    if m < MIN_GEMM_ROWS:
        queries = torch.cat([queries, queries.new_zeros((MIN_GEMM_ROWS - m, queries.shape[1]))])
    if n < MIN_GEMM_ROWS:
        items = torch.cat([items, items.new_zeros((MIN_GEMM_ROWS - n, items.shape[1]))])
    scores = queries @ items.t()
    return scores if scores.shape == (m, n) else scores[:m, :n]


def exclude_history(scores: torch.Tensor, targets: torch.Tensor, hist: np.ndarray, hoff: np.ndarray) -> None:
    """In place: item 0 and every earlier item of each row's user score -inf; the target keeps its score
    even when the user saw it before (a repeat is still a hit)."""
    scores[:, 0] = -torch.inf
    row_of = torch.from_numpy(np.repeat(np.arange(len(hoff) - 1), np.diff(hoff))).to(scores.device)
    keep = scores.gather(1, targets[:, None]).clone()
    scores[row_of, torch.from_numpy(hist).to(scores.device)] = -torch.inf
    scores.scatter_(1, targets[:, None], keep)


@torch.no_grad()
def eval_ranks(model: nn.Module, split: LeaveOneOut, which: str, rows: np.ndarray, *, max_len: int,
               batch_size: int, device: torch.device, tick: Callable[[], None] | None = None) -> np.ndarray:
    """0-based rank of each target among all items, for the users at ``rows``; ``tick`` is called after
    every chunk (a distributed watchdog's heartbeat)."""
    was_training = model.training
    model.eval()
    items = model.item_vectors()  # [I + 1, d]
    out = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo : lo + batch_size]
        batch, targets = split.eval_batch(which, chunk, max_len)
        batch, targets = batch.to(device), targets.to(device)
        scores = score_items(model.query_vectors(last_token_outputs(model.encode(batch), batch.offsets)), items)
        exclude_history(scores, targets, *split.full_history(which, chunk))
        out.append(target_ranks(scores, targets).cpu().numpy())
        if tick is not None:
            tick()
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def evaluate(model: nn.Module, split: LeaveOneOut, which: str, *, max_len: int, ks: list[int],
             batch_size: int = 512, device: torch.device | None = None,
             max_users: int | None = None) -> dict[str, float]:
    """HR@K, NDCG@K and MRR on the ``which`` target ('valid' or 'test')."""
    rows = np.arange(split.num_users)
    if max_users is not None and max_users < len(rows):
        rows = np.sort(np.random.default_rng(0).choice(rows, size=max_users, replace=False))
    ranks = eval_ranks(model, split, which, rows, max_len=max_len, batch_size=batch_size,
                       device=device or torch.device("cpu"))
    return metrics_from_ranks(ranks, ks)

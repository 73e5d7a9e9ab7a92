"""Leave-one-out full-ranking evaluation: the target against all items, the user's earlier items excluded."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks


def last_token_outputs(outputs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return outputs[offsets[1:] - 1]


@torch.no_grad()
def evaluate(model: nn.Module, split: LeaveOneOut, which: str, *, max_len: int, ks: list[int],
             batch_size: int = 512, device: torch.device | None = None,
             max_users: int | None = None) -> dict[str, float]:
    """HR@K, NDCG@K and MRR on the ``which`` target ('valid' or 'test')."""
    device = device or torch.device("cpu")
    was_training = model.training
    model.eval()
    items = model.item_vectors()  # [I + 1, d]
    rows = np.arange(split.num_users)
    if max_users is not None and max_users < len(rows):
        rows = np.random.default_rng(0).choice(rows, size=max_users, replace=False)
        rows.sort()
    ranks = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo : lo + batch_size]
        batch, targets = split.eval_batch(which, chunk, max_len)
        batch = batch.to(device)
        targets = targets.to(device)
        q = model.query_vectors(last_token_outputs(model.encode(batch), batch.offsets))
        scores = q @ items.t()
        scores[:, 0] = -torch.inf
        hist, hoff = split.full_history(which, chunk)
        row_of = np.repeat(np.arange(len(chunk)), np.diff(hoff))
        target_score = scores.gather(1, targets[:, None]).clone()
        scores[torch.from_numpy(row_of).to(device), torch.from_numpy(hist).to(device)] = -torch.inf
        scores.scatter_(1, targets[:, None], target_score)
        ranks.append(target_ranks(scores, targets).cpu().numpy())
    model.train(was_training)
    return metrics_from_ranks(np.concatenate(ranks) if ranks else np.zeros(0), ks)

"""Ranking metrics from 0-based ranks of the target among all candidate items."""

from __future__ import annotations

import numpy as np
import torch


def target_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-based rank of each row's target; ties count against the target (pessimistic), so a model that
    scores everything equally gets no credit."""
    target_scores = scores.gather(1, targets[:, None])
    ahead = (scores >= target_scores).sum(dim=1) - 1  # minus the target itself
    return ahead


def metrics_from_ranks(ranks: np.ndarray, ks: list[int]) -> dict[str, float]:
    ranks = np.asarray(ranks, dtype=np.float64)
    out: dict[str, float] = {}
    if ranks.size == 0:
        return {**{f"{m}@{k}": 0.0 for k in ks for m in ("hr", "ndcg")}, "mrr": 0.0}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
    out["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    return out

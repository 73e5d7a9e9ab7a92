"""Losses: sampled softmax (InfoNCE) for retrieval, BCE for the ranking head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = -1e9


def sample_negatives(num_items: int, shape: tuple[int, ...], generator: torch.Generator,
                     device: torch.device) -> torch.Tensor:
    """Uniform item ids in 1..num_items (0 is padding)."""
    ids = torch.randint(1, num_items + 1, shape, generator=generator)
    return ids.to(device)


def sampled_softmax_loss(query: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, targets: torch.Tensor,
                         neg_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean InfoNCE over tokens.

    query, pos: [N, d] (L2-normalised); neg: [R, d] shared by all tokens, or [N, R, d] per token;
    targets: [N]; neg_ids: [R] or [N, R]. A sampled negative equal to the token's target is masked out.
    """
    pos_logit = (query * pos).sum(-1, keepdim=True)
    if neg.dim() == 2:
        neg_logits = query @ neg.t()
        collide = neg_ids[None, :] == targets[:, None]
    else:
        neg_logits = torch.bmm(neg, query.unsqueeze(-1)).squeeze(-1)
        collide = neg_ids == targets[:, None]
    neg_logits = neg_logits.masked_fill(collide, NEG_INF)
    logits = torch.cat([pos_logit, neg_logits], dim=1) / temperature
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def ranking_bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

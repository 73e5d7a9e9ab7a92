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

    query, pos: [N, d] (L2-normalised); targets: [N]. Negatives either shared by every token (neg [R, d],
    neg_ids [R]) or one set per group of ``k = ceil(N / G)`` consecutive tokens (neg [G, R, d], neg_ids
    [G, R]; G = N is one set per token). A sampled negative equal to the token's target is masked out.
    """
    n = query.shape[0]
    pos_logit = (query * pos).sum(-1, keepdim=True)
    if neg.dim() == 2:
        neg_logits = query @ neg.t()
        collide = neg_ids[None, :] == targets[:, None]
    else:
        groups = neg.shape[0]
        k = -(-n // groups)
        q = torch.cat([query, query.new_zeros(groups * k - n, query.shape[1])]) if groups * k != n else query
        neg_logits = torch.bmm(q.reshape(groups, k, -1), neg.transpose(1, 2)).reshape(groups * k, -1)[:n]
        group_of = torch.arange(n, device=query.device) // k
        collide = neg_ids[group_of] == targets[:, None]
    neg_logits = neg_logits.masked_fill(collide, NEG_INF)
    logits = torch.cat([pos_logit, neg_logits], dim=1) / temperature
    return (torch.logsumexp(logits, dim=1) - logits[:, 0]).mean()


def negative_shape(sharing: str, num_tokens: int, negatives: int, group_size: int) -> tuple[int, ...]:
    """Shape of the sampled negative ids for one batch under a sharing mode."""
    if sharing == "batch":
        return (negatives,)
    groups = num_tokens if sharing == "token" else max(1, -(-num_tokens // group_size))
    return (groups, negatives)


def ranking_bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

"""Jagged-tensor primitives: pure tensor math on ``offsets`` ([B + 1], int64, ``offsets[0] == 0``).

A jagged tensor is flat values [sum_L, *D] plus offsets; sequence b is rows ``offsets[b]:offsets[b+1]``.
These helpers are what every layer of the stack shares (data batches, models, kernels, serving).
"""

from __future__ import annotations

import torch


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] int64 offsets (on the lengths' device)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def segment_ids(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[sum_L] index of the sequence each token belongs to. ``total`` (sum_L, when the caller knows it, e.g.
    from the values' shape) spares an accelerator the read-back of the output size."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                   output_size=total)


def positions(offsets: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[sum_L] position of each token inside its sequence (``total``: as in :func:`segment_ids`)."""
    seg = segment_ids(offsets, total)
    n = int(offsets[-1]) if total is None else total
    return torch.arange(n, device=offsets.device) - offsets[seg]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None,
                     pad: float = 0.0) -> torch.Tensor:
    """[sum_L, *D] -> [B, L_max, *D]. For tests, baselines and benchmarks, not the hot path."""
    lengths = offsets[1:] - offsets[:-1]
    L = int(lengths.max()) if max_len is None and lengths.numel() else int(max_len or 0)
    B = lengths.numel()
    out = values.new_full((B, L, *values.shape[1:]), pad)
    pos = positions(offsets)
    seg = segment_ids(offsets)
    keep = pos < L
    out[seg[keep], pos[keep]] = values[keep]
    return out


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, L_max, *D] -> [sum_L, *D]."""
    return padded[segment_ids(offsets), positions(offsets)]

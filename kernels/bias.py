"""The relative attention bias's time buckets, shared by every backend (torch, Triton, CPU prefix path).

``bucket(dt) = clamp(floor(ln(max(|dt|, 1)) / TIME_BUCKET_DIV), 0, T)`` with ``T = len(time_w) - 1``.
"""

from __future__ import annotations

import torch

TIME_BUCKET_DIV = 0.301


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Log-bucketed absolute time gaps, in ``0..num_buckets``."""
    x = dt.abs().clamp(min=1).to(torch.float32)
    return (torch.log(x) / TIME_BUCKET_DIV).floor().clamp(0, num_buckets).to(torch.int64)

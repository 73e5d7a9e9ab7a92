"""Jagged batches: flat values plus offsets, the layout every hot path uses (no [B, L_max] padding)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class JaggedBatch:
    """A batch of B sequences with sum_L tokens in total.

    ``item_ids``/``timestamps`` are [sum_L]; ``offsets`` is [B + 1]. ``targets`` (optional, [sum_L]) is the
    next item each position should predict (0 = no supervision). ``num_targets`` (optional, [B]) counts
    candidate tokens at the end of each sequence for the ranking head.
    """

    item_ids: torch.Tensor
    offsets: torch.Tensor
    timestamps: torch.Tensor
    targets: torch.Tensor | None = None
    actions: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    user_index: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.item_ids.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return JaggedBatch(**moved)

    def pin_memory(self) -> JaggedBatch:
        pinned = {}
        for f in fields(self):
            v = getattr(self, f.name)
            pinned[f.name] = v.pin_memory() if isinstance(v, torch.Tensor) else v
        return JaggedBatch(**pinned)


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def segment_ids(offsets: torch.Tensor) -> torch.Tensor:
    """[sum_L] index of the sequence each token belongs to."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)


def positions(offsets: torch.Tensor) -> torch.Tensor:
    """[sum_L] position of each token inside its sequence."""
    seg = segment_ids(offsets)
    return torch.arange(int(offsets[-1]), device=offsets.device) - offsets[seg]


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

"""The inputs of one jagged attention call, as the dispatcher hands them to every backend.

The public ops (:func:`grstack.kernels.hstu_attention`, :func:`grstack.kernels.bias_channel_attention`) keep
their keyword signatures; they build one :class:`AttentionInputs` (checked once, here) and each backend takes
it, instead of the same ten arguments repeated in every backend's signature.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionInputs:
    """q, k: [sum_L, H, dqk]; v: [sum_L, H, dv]; offsets: [B + 1]; the bias tables and batch facts.

    ``timestamps`` [sum_L]: the keys' times; ``query_timestamps`` [sum_L] (laid out like ``timestamps``): the
    time each query token queries at in the time bias (None: its own). ``num_targets`` [B]: candidate tokens
    at the end of each sequence. A bias-only channel (FuXi-α) has no queries or keys: q and k are ``v``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor
    max_seq_len: int
    timestamps: torch.Tensor | None = None
    pos_weight: torch.Tensor | None = None
    time_weight: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    query_timestamps: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_query_timestamps(self.query_timestamps, self.timestamps)

    @classmethod
    def channel(cls, v: torch.Tensor, offsets: torch.Tensor, **kwargs) -> AttentionInputs:
        """A bias-only channel's inputs (no queries or keys: both are ``v``)."""
        return cls(v, v, v, offsets, **kwargs)

    def replace(self, **changes) -> AttentionInputs:
        return dataclasses.replace(self, **changes)

    @property
    def uses_time(self) -> bool:
        """The time bias is on: a table and the keys' times."""
        return self.time_weight is not None and self.timestamps is not None


def check_query_timestamps(query_timestamps: torch.Tensor | None, timestamps: torch.Tensor | None) -> None:
    if query_timestamps is None:
        return
    if timestamps is None:
        raise ValueError("query_timestamps need timestamps (the keys' times)")
    if query_timestamps.shape != timestamps.shape:
        raise ValueError(f"query_timestamps {tuple(query_timestamps.shape)} must be laid out like timestamps "
                         f"{tuple(timestamps.shape)}")

"""Jagged batches: flat values plus offsets, the layout every hot path uses (no [B, L_max] padding).

The primitives on offsets (``lengths_to_offsets``, ``segment_ids``, ``positions``, ``jagged_to_padded``,
``padded_to_jagged``) are :mod:`grstack.kernels`'; this module holds the batch the data pipeline produces.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class JaggedBatch:
    """A batch of B sequences with sum_L tokens in total.

    ``item_ids``/``timestamps`` are [sum_L]; ``offsets`` is [B + 1]. ``targets`` (optional, [sum_L]) is the
    next item each position should predict (0 = no supervision). ``num_targets`` (optional, [B]) counts
    candidate tokens at the end of each sequence for the ranking head. ``actions`` ([sum_L]) are the action
    bits of each position's *target* event (the ranking labels); ``input_actions`` ([sum_L]) each token's
    *own* action bits, what a model with action inputs reads (-1 on candidates: their actions are the labels).
    ``context`` ([B, C, W]) holds each sequence's user-feature value ids per field (0 = none), what a model
    with user context turns into contextual tokens.

    ``host_lengths`` (B ints, host memory): the sequences' lengths as the host knows them, so a model on a
    device builds its per-batch plan without reading ``offsets`` back (a host sync per forward). Derived from
    ``offsets`` when they are on the CPU and none are given (every batch the data pipeline builds), carried
    as they are by :meth:`to` and :meth:`pin_memory`. Given ones are checked against the shapes only (the
    offsets are not read), so a batch made from another with new offsets (``dataclasses.replace``) must pass
    ``host_lengths=None`` or the new lengths. A batch built on a device without them has None, and a consumer
    reads the offsets instead.
    """

    item_ids: torch.Tensor
    offsets: torch.Tensor
    timestamps: torch.Tensor
    targets: torch.Tensor | None = None
    actions: torch.Tensor | None = None
    num_targets: torch.Tensor | None = None
    user_index: torch.Tensor | None = None
    input_actions: torch.Tensor | None = None
    context: torch.Tensor | None = None
    host_lengths: tuple[int, ...] | None = field(default=None, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        if self.host_lengths is None:
            if self.offsets.device.type == "cpu":  # host memory: no sync, and once per batch
                self.host_lengths = tuple((self.offsets[1:] - self.offsets[:-1]).tolist())
            return
        given = tuple(int(n) for n in self.host_lengths)
        if len(given) != self.batch_size or sum(given) != self.num_tokens:
            raise ValueError(f"host_lengths: {len(given)} sequences of {sum(given)} tokens for a batch of "
                             f"{self.batch_size} sequences of {self.num_tokens} tokens")
        self.host_lengths = given

    def host_lengths_with_context(self, num_context: int) -> tuple[int, ...] | None:
        """Host lengths of the sequences with ``num_context`` contextual tokens heading each (what a model with
        user context runs its layers on); None when the batch has no host lengths."""
        if self.host_lengths is None or not num_context:
            return self.host_lengths
        return tuple(n + num_context for n in self.host_lengths)

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
        moved: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return JaggedBatch(**moved)

    def pin_memory(self) -> JaggedBatch:
        """A copy in page-locked host memory, so that ``to(device, non_blocking=True)`` overlaps (from pageable
        memory the driver stages the copy synchronously). Needs an accelerator (CUDA / Ascend)."""
        pinned: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            pinned[f.name] = v.pin_memory() if isinstance(v, torch.Tensor) else v
        return JaggedBatch(**pinned)

"""Length-bucketed plans for computing attention on jagged sequences on CPU without padding to L_max.

Sequences are grouped into length classes (powers of 2^(1/4)); each group is gathered into a small dense
block padded only to that group's own longest sequence. Attention work is then ``sum_g G_g * L_g^2``, within
a small constant of the jagged ``sum_b L_b^2``, instead of ``B * L_max^2``. A plan depends only on the
offsets, so a model computes it once per batch and reuses it in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Group:
    seq: torch.Tensor  # [G] sequence indices in the batch
    index: torch.Tensor  # [G, Lg] token index into the values (pad slots point at the zero row, sum_L)
    valid: torch.Tensor  # [G * Lg] bool, slots holding real tokens
    lengths: torch.Tensor  # [G]
    max_len: int


@dataclass(frozen=True)
class JaggedPlan:
    num_tokens: int
    groups: tuple[Group, ...]
    inverse: torch.Tensor  # [sum_L]: position of each token in the concatenation of the groups' valid slots


def _length_class(length: int, steps_per_octave: int = 4) -> int:
    return 0 if length <= 1 else math.ceil(steps_per_octave * math.log2(length))


def make_plan(offsets: torch.Tensor, steps_per_octave: int = 4) -> JaggedPlan:
    """Groups sequences of similar length; empty sequences are skipped."""
    offs = offsets.to("cpu", torch.int64)
    lengths = (offs[1:] - offs[:-1]).tolist()
    device = offsets.device
    by_class: dict[int, list[int]] = {}
    for b, length in enumerate(lengths):
        if length > 0:
            by_class.setdefault(_length_class(length, steps_per_octave), []).append(b)
    num_tokens = int(offs[-1])
    groups = []
    order = []
    for cls in sorted(by_class, reverse=True):
        seqs = by_class[cls]
        lens = torch.tensor([lengths[b] for b in seqs], dtype=torch.int64)
        max_len = int(lens.max())
        starts = offs[torch.tensor(seqs)]
        ar = torch.arange(max_len, dtype=torch.int64)
        valid2d = ar[None, :] < lens[:, None]
        index = torch.where(valid2d, starts[:, None] + ar[None, :], torch.full_like(valid2d, num_tokens,
                                                                                 dtype=torch.int64))
        valid = valid2d.reshape(-1)
        order.append(index.reshape(-1)[valid])
        groups.append(Group(seq=torch.tensor(seqs, device=device), index=index.to(device),
                            valid=valid.to(device), lengths=lens.to(device), max_len=max_len))
    if order:
        cat = torch.cat(order)
        inverse = torch.empty(num_tokens, dtype=torch.int64)
        inverse[cat] = torch.arange(num_tokens, dtype=torch.int64)
    else:
        inverse = torch.zeros(0, dtype=torch.int64)
    return JaggedPlan(num_tokens=num_tokens, groups=tuple(groups), inverse=inverse.to(device))


def gather_groups(x: torch.Tensor, plan: JaggedPlan) -> list[torch.Tensor]:
    """[sum_L, *D] -> per group [G, Lg, *D] (pad slots are zeros)."""
    ext = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
    return [ext[g.index] for g in plan.groups]


def scatter_groups(blocks: list[torch.Tensor], plan: JaggedPlan) -> torch.Tensor:
    """Inverse of ``gather_groups``: per group [G, Lg, *D] -> [sum_L, *D] (pad slots dropped)."""
    parts = [blk.reshape(-1, *blk.shape[2:])[g.valid] for blk, g in zip(blocks, plan.groups, strict=True)]
    if not parts:
        return blocks[0].new_zeros((0,)) if blocks else torch.zeros(0)
    return torch.cat(parts, dim=0)[plan.inverse]

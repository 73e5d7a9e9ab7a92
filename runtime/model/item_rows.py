"""The item table's rows when they live outside the model (the sharded embedding of training).

``initial_item_rows`` gives any subset of the table's initial rows, each a pure function of (seed, row id):
a rank materialises only the rows it owns, on its own device, and the initial table is the same whatever
the number of ranks, without any rank ever building the whole table. The values are N(0, std²) from a
counter-based hash (two 32-bit integer mixes per element, Box-Muller), the distribution the models'
``nn.Embedding`` init draws from.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ITEM_INIT_STD = 0.02  # the item embedding's init scale in both models
_MASK = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (values kept below 2^32 in int64, so no product overflows)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK
    return (x >> 16) ^ x


def initial_item_rows(seed: int, ids: torch.Tensor, dim: int, std: float = ITEM_INIT_STD,
                      device: torch.device | None = None) -> torch.Tensor:
    """[len(ids), dim] float32 initial rows of global item ids ``ids`` (row ``i`` never depends on which
    other rows are asked for)."""
    device = device if device is not None else ids.device
    ids = ids.to(device=device, dtype=torch.int64)
    s = _mix(torch.tensor(seed & _MASK, dtype=torch.int64, device=device) ^ 0x2545F491)
    row = _mix((ids & _MASK) ^ s)
    row = _mix(row ^ _mix((ids >> 32) + 0x9E3779B9))  # ids beyond 2^32 stay distinct
    col = torch.arange(dim, dtype=torch.int64, device=device)
    a = _mix((row[:, None] + col[None, :] * 0x9E3779B1) & _MASK)
    b = _mix(a ^ 0x68E31DA4)
    u1 = (a.double() + 0.5) / 2.0**32  # in (0, 1): the log is finite
    u2 = (b.double() + 0.5) / 2.0**32
    z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
    return (z * std).float()


class ExternalItemRows(nn.Module):
    """Stands in for ``model.item_emb`` when the rows live elsewhere (sharded): it holds no weight, so the
    model never allocates the whole table; callers pass looked-up rows (``item_rows=``/``rows=``)."""

    def __init__(self, num_rows: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_rows, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("item embeddings are sharded: pass looked-up rows (item_rows=/rows=/cand_rows=)")

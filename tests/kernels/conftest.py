"""Kernel tests run the Triton kernels in the interpreter on CPU unless ``GRSTACK_KERNEL_TEST_DEVICE=cuda``.

Triton (3.9) reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is decorated, i.e. when our kernel
modules are imported; so it is set here, before any test module imports them, and modules imported
earlier in this process without it are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

DEVICE = os.environ.get("GRSTACK_KERNEL_TEST_DEVICE", "cpu")
_TRITON_MODULES = (
    "grstack.kernels.triton_util",
    "grstack.kernels.triton_hstu",
    "grstack.kernels.triton_norm",
    "grstack.kernels.triton_embedding",
)

if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in _TRITON_MODULES:
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture
def device() -> str:
    return DEVICE


def _offsets(lengths: list[int]):
    import torch

    offs = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offs[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return offs


class JaggedCase:
    """Random jagged attention inputs (seeded): q, k, v, offsets, timestamps, tables, num_targets."""

    def __init__(self, lengths: list[int], heads: int, dqk: int, dv: int, *, seed: int, max_seq_len: int = 64,
                 num_time_buckets: int = 32, device: str = "cpu"):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.offsets = _offsets(lengths).to(device)
        n = int(sum(lengths))
        self.q = torch.randn(n, heads, dqk, generator=g).to(device)
        self.k = torch.randn(n, heads, dqk, generator=g).to(device)
        self.v = torch.randn(n, heads, dv, generator=g).to(device)
        gaps = torch.randint(0, 3, (n,), generator=g) * torch.randint(0, 100_000, (n,), generator=g)
        self.timestamps = torch.cumsum(gaps, 0).to(device)
        self.pos_weight = (0.5 * torch.randn(max_seq_len, generator=g)).to(device)
        self.time_weight = (0.5 * torch.randn(num_time_buckets + 1, generator=g)).to(device)
        self.num_targets = torch.tensor(
            [int(torch.randint(0, length + 1, (1,), generator=g)) for length in lengths], dtype=torch.int64
        ).to(device)
        self.max_seq_len = max_seq_len


@pytest.fixture
def jagged_case():
    return JaggedCase


@pytest.fixture
def offsets_of():
    return _offsets

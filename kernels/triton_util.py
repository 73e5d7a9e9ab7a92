"""Shared helpers for the Triton kernels: interpreter detection, device checks, jagged tile lists.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is *decorated*, i.e. when
the kernel module is imported: ``TRITON_INTERPRET=1`` must be in the environment before that import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors via numpy)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_device(kernel: object, *tensors: torch.Tensor | None) -> bool:
    """Validates the tensors' device for ``kernel`` and returns whether it is interpreted.

    The interpreter has a bug with ``tl.dot`` on bfloat16 (it multiplies the raw uint16 bit patterns), so
    interpreted kernels round dot operands to the storage dtype and multiply in fp32 instead.
    """
    interpreted = is_interpreted(kernel)
    for t in tensors:
        if t is None:
            continue
        if interpreted and t.device.type != "cpu":
            raise RuntimeError("Triton kernels were imported under TRITON_INTERPRET=1 and need CPU tensors")
        if not interpreted and t.device.type != "cuda":
            raise RuntimeError(
                f"the triton backend needs CUDA tensors (got {t.device}); on CPU set TRITON_INTERPRET=1 "
                "before grstack.kernels' Triton modules are imported, or use the reference backend"
            )
    return interpreted


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow torch's TF32 switch, so the Triton and torch paths agree on the same machine."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def block_dim(d: int) -> int:
    """Padded head dimension: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(d))


def jagged_tiles(offsets: torch.Tensor, num_tokens: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile per ``block`` tokens of each sequence: (sequence index, block index), longest sequences first.

    Built on the offsets' device with no host synchronisation, so a forward or backward never waits on the
    device and can be captured in a CUDA graph. The list has a fixed length that the host knows without
    reading the offsets, ``num_tokens // block + B`` (an upper bound of ``sum_b ceil(L_b / block)``); the
    tiles past the real ones have sequence index -1 and their programs return at once. Only tiles that hold
    tokens do work, so a heavy-tailed batch costs ``sum_b ceil(L_b / block)`` programs per head instead of
    ``B * ceil(L_max / block)``; launching the long sequences' tiles first balances the tail.
    """
    batch = offsets.numel() - 1
    size = num_tokens // block + batch
    if batch == 0:
        empty = torch.full((size,), -1, dtype=torch.int32, device=offsets.device)
        return empty, empty.clone()
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    order = torch.argsort(lengths, descending=True, stable=True)
    counts = (lengths[order] + block - 1) // block
    ends = torch.cumsum(counts, 0)
    t = torch.arange(size, device=offsets.device, dtype=torch.int64)
    rank = torch.searchsorted(ends, t, right=True)
    real = rank < batch
    rank = rank.clamp(max=batch - 1)
    seq = torch.where(real, order[rank], -1)
    blk = torch.where(real, t - (ends - counts)[rank], 0)
    return seq.to(torch.int32), blk.to(torch.int32)


@triton.jit
def mm(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32; operands already in their storage dtype (bf16/fp16/fp32)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)

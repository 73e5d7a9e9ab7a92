"""Padding-free embedding gather for flat jagged ids in Triton, with an atomic scatter-add backward.

Ids are the jagged batch's flat [sum_L] values, so no [B, L_max] id or embedding tensor exists. The
backward adds each token's gradient row into its table row with fp32 atomics (repeated ids — popular items
— are summed in place, no sort), then casts to the table's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grstack.kernels.triton_util import check_device


@triton.jit
def _gather_fwd(TABLE, IDS, OUT, n, D, stride_t, stride_o, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < n
    mask = tok_ok[:, None] & (cols[None, :] < D)
    ids = tl.load(IDS + toks, mask=tok_ok, other=0).to(tl.int64)
    rows = tl.load(TABLE + ids[:, None] * stride_t + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + toks.to(tl.int64)[:, None] * stride_o + cols[None, :], rows, mask=mask)


@triton.jit
def _gather_bwd(GRAD, IDS, DTABLE, n, D, stride_g, stride_t, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < n
    mask = tok_ok[:, None] & (cols[None, :] < D)
    ids = tl.load(IDS + toks, mask=tok_ok, other=0).to(tl.int64)
    g = tl.load(GRAD + toks.to(tl.int64)[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    tl.atomic_add(DTABLE + ids[:, None] * stride_t + cols[None, :], g.to(tl.float32), mask=mask, sem="relaxed")


def _blocks(d: int) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(max(d, 1)), 256)
    return max(1, 4096 // block_d // 4), block_d


class _EmbeddingGather(torch.autograd.Function):
    """Rows keep the table's dtype under autocast (as ``torch.nn.functional.embedding``); the gradient is
    accumulated in fp32."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, table, ids):
        check_device(_gather_fwd, table, ids)
        if table.stride(-1) != 1:
            table = table.contiguous()
        flat = ids.reshape(-1)
        n, d = flat.numel(), table.shape[1]
        if n:
            torch._assert_async(((flat >= 0) & (flat < table.shape[0])).all(),
                                "embedding_gather: id out of range")
        out = torch.empty((n, d), dtype=table.dtype, device=table.device)
        block_t, block_d = _blocks(d)
        if n and d:
            _gather_fwd[(triton.cdiv(n, block_t), triton.cdiv(d, block_d))](
                table, flat, out, n, d, table.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_D=block_d)
        ctx.save_for_backward(flat)
        ctx.table_shape = table.shape
        ctx.table_dtype = table.dtype
        return out.reshape(*ids.shape, d)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        (flat,) = ctx.saved_tensors
        rows, d = ctx.table_shape
        g = grad.reshape(-1, d)
        if g.stride(-1) != 1:
            g = g.contiguous()
        dtable = torch.zeros((rows, d), dtype=torch.float32, device=g.device)
        n = flat.numel()
        block_t, block_d = _blocks(d)
        if n and d:
            _gather_bwd[(triton.cdiv(n, block_t), triton.cdiv(d, block_d))](
                g, flat, dtable, n, d, g.stride(0), dtable.stride(0), BLOCK_T=block_t, BLOCK_D=block_d)
        return dtable.to(ctx.table_dtype), None


def embedding_gather_triton(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` [V, D] for ``ids`` (any shape, typically flat jagged [sum_L]) -> [*ids.shape, D]."""
    return _EmbeddingGather.apply(table, ids)

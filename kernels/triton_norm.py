"""Fused jagged ``LayerNorm(x) * u`` (HSTU's normalised attention output gated by U) in Triton.

Unfused, torch reads x, writes LN(x), reads it again with u and writes the product; the backward makes
several more passes. Here the forward is one read of x and u and one write (plus per-row mean and rstd),
the backward one read of x, u, grad and one write of dx and du, with the weight/bias gradients reduced per
program in registers and summed over programs afterwards (no atomics, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grstack.kernels.triton_util import check_device


@triton.jit
def _ln_mul_fwd(X, U, W, B, Y, MEAN, RSTD, n_rows, D, stride_x, stride_u, stride_y, eps,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + r64[:, None] * stride_y + cols[None, :], (y * u).to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _ln_mul_bwd(X, U, W, B, G, MEAN, RSTD, DX, DU, DW_PART, DB_PART, n_rows, D, rows_per_prog,
                stride_x, stride_u, stride_g, stride_dx, stride_du,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.full((BLOCK_D,), 1.0, tl.float32)
    bb = tl.zeros((BLOCK_D,), tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_B:
        bb = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), tl.float32)
    db = tl.zeros((BLOCK_D,), tl.float32)
    first = pid * rows_per_prog
    last = tl.minimum(first + rows_per_prog, n_rows)
    for r0 in range(first, last, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < last
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)
        x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + r64[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + r64[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        du = g * (xhat * w[None, :] + bb[None, :])
        dy = g * u
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
        dxhat = dy * w[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) / D
        c2 = tl.sum(dxhat, axis=1) / D
        dx = (dxhat - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + r64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DU + r64[:, None] * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid * D + cols, dw, mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * D + cols, db, mask=col_ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _row_block(d_pow2: int) -> int:
    """Rows per program: at most 2,048 elements, so the backward's five row tiles fit in registers (4,096
    spilled at d=256 in fp32 on sm_90)."""
    return max(1, min(16, 2048 // d_pow2))


class _LayerNormMul(torch.autograd.Function):
    """Statistics and the normalisation in fp32 whatever the inputs; under autocast x (the fp32 residual
    stream) and u (a bf16 projection) may differ, and the result has their promoted dtype, as torch's
    ``layer_norm(x) * u`` would."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, u, weight, bias, eps):
        check_device(_ln_mul_fwd, x, u)
        shape = x.shape
        x2, u2 = _rows(x), _rows(u)
        n, d = x2.shape
        y = torch.empty((n, d), dtype=torch.promote_types(x.dtype, u.dtype), device=x.device)
        mean = torch.empty(n, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block_d = triton.next_power_of_2(d)
        block_r = _row_block(block_d)
        if n:
            _ln_mul_fwd[(triton.cdiv(n, block_r),)](
                x2, u2, weight if weight is not None else x2, bias if bias is not None else x2, y, mean, rstd,
                n, d, x2.stride(0), u2.stride(0), y.stride(0), eps,
                HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            )
        ctx.save_for_backward(x2, u2, weight, bias, mean, rstd)
        ctx.shape = shape
        return y.reshape(shape)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad):
        x2, u2, weight, bias, mean, rstd = ctx.saved_tensors
        g = _rows(grad)
        n, d = x2.shape
        dx = torch.empty_like(x2)
        du = torch.empty_like(u2)
        block_d = triton.next_power_of_2(d)
        block_r = _row_block(block_d)
        rows_per_prog = max(block_r, triton.cdiv(n, 256 * block_r) * block_r)
        progs = max(1, triton.cdiv(n, rows_per_prog))
        dw = torch.zeros((progs, d), dtype=torch.float32, device=x2.device)
        db = torch.zeros((progs, d), dtype=torch.float32, device=x2.device)
        if n:
            _ln_mul_bwd[(progs,)](
                x2, u2, weight if weight is not None else x2, bias if bias is not None else x2, g, mean, rstd,
                dx, du, dw, db, n, d, rows_per_prog,
                x2.stride(0), u2.stride(0), g.stride(0), dx.stride(0), du.stride(0),
                HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_R=block_r, BLOCK_D=block_d,
            )
        dweight = dw.sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        dbias = db.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return dx.reshape(ctx.shape), du.reshape(ctx.shape), dweight, dbias, None


def layer_norm_mul_triton(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """``LayerNorm(x) * u`` over the last dimension; differentiable in x, u, weight and bias."""
    if u.shape != x.shape:
        raise ValueError(f"u must have x's shape {tuple(x.shape)}, got {tuple(u.shape)}")
    return _LayerNormMul.apply(x, u, weight, bias, eps)

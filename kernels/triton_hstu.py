"""Fused jagged HSTU attention in Triton: forward, backward, and the cached-prefix (serving) forward.

The math is exactly :mod:`grstack.kernels.reference`'s. Programs are launched over (jagged tile, head),
where a tile is ``BLOCK`` consecutive tokens of one sequence (see :func:`triton_util.jagged_tiles`): no
padding to L_max and no [B, L, L] tensor — Q·Kᵀ, the position/time bias (gathered from the two small
weight tables by in-kernel indices), SiLU, the mask, the 1/N scale and ·V happen in registers.

Key loops visit only blocks that can hold allowed pairs: for queries in the history, keys up to the
diagonal; for candidate queries (``num_targets``), the history plus their own diagonal block.

Backward: one kernel over key tiles computes dK, dV and the bias-table gradients (every (i, j) pair is
visited exactly once there; table gradients go through fp32 atomics spread over ``_GRAD_SLOTS`` copies to
limit contention), a second kernel over query tiles computes dQ without atomics.

Serving: query tokens are positions ``P..P+S-1`` of a sequence whose first ``P`` tokens' K/V are cached;
the same forward kernel first sweeps the cached prefix (all of it is visible to every new token), then the
new tokens' own K/V causally.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grstack.kernels.bias import TIME_BUCKET_DIV
from grstack.kernels.triton_util import block_dim, check_device, dot_precision, jagged_tiles, mm

_GRAD_SLOTS = 32


@triton.jit
def _scores(q, k, gi, gj, row_ok, col_ok, hist, ts_i, ts_j, pos_w, time_w, num_pos, num_tb,
            HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            TB_DIV: tl.constexpr):
    """Biased scores [BM, BN], the allowed-pair mask and the two table indices of every pair."""
    s = mm(q, tl.trans(k), UPCAST, PRECISION)
    allowed = (row_ok[:, None] & col_ok[None, :] & (gj[None, :] <= gi[:, None])
               & ((gj[None, :] < hist) | (gj[None, :] == gi[:, None])))
    pi = tl.minimum(gi, hist)
    pj = tl.minimum(gj, hist)
    dist = tl.minimum(tl.maximum(pi[:, None] - pj[None, :], 0), num_pos - 1)
    bucket = tl.zeros_like(dist)
    if HAS_POS:
        s += tl.load(pos_w + dist).to(tl.float32)
    if HAS_TIME:
        dt = tl.maximum(tl.abs(ts_i[:, None] - ts_j[None, :]), 1).to(tl.float32)
        lb = tl.floor(tl.log(dt) / TB_DIV)
        bucket = tl.minimum(tl.maximum(lb, 0.0), num_tb).to(tl.int32)
        s += tl.load(time_w + bucket).to(tl.float32)
    return s, allowed, dist, bucket


@triton.jit
def _fwd_sweep(acc, q, gi, row_ok, hist, ts_i, K, V, TSK, key_tok0, gpos0, lo, hi, stride_kt, stride_vt,
               pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
               HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc += A[:, lo:hi] @ V[lo:hi] for one key range; K/V/TSK point at this head's token 0."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        tok = (key_tok0 + offs_n).to(tl.int64)
        k = tl.load(K + tok[:, None] * stride_kt + offs_dk[None, :],
                    mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
        v = tl.load(V + tok[:, None] * stride_vt + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_j = ts_i
        if HAS_TIME:
            ts_j = tl.load(TSK + tok, mask=col_ok, other=0)
        s, allowed, _, _ = _scores(q, k, gi, gpos0 + offs_n, row_ok, col_ok, hist, ts_i, ts_j, pos_w, time_w,
                                   num_pos, num_tb, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV)
        a = tl.where(allowed, s * tl.sigmoid(s) * inv_n, 0.0)
        acc += mm(a.to(v.dtype), v, UPCAST, PRECISION)
    return acc


@triton.jit
def _hstu_fwd(Q, K, V, KP, VP, OUT, seq_offsets, prefix_starts, prefix_lengths, num_targets, TS, TSP, pos_w, time_w,
              tile_seq, tile_blk,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_kpt, stride_kph, stride_vpt, stride_vph, stride_ot, stride_oh,
              inv_n, num_pos, num_tb, D_QK, D_V,
              HAS_PREFIX: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_TIME: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TB_DIV: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tile_seq + pid)
    start_m = tl.load(tile_blk + pid) * BLOCK_M
    seq0 = tl.load(seq_offsets + b).to(tl.int64)
    S = (tl.load(seq_offsets + b + 1) - seq0).to(tl.int32)
    P = 0
    p0 = seq0
    if HAS_PREFIX:
        p0 = tl.load(prefix_starts + b).to(tl.int64)
        P = tl.load(prefix_lengths + b).to(tl.int32)
    L = P + S
    hist = L
    if HAS_TARGETS:
        hist = tl.maximum(L - tl.load(num_targets + b).to(tl.int32), 0)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < S
    gi = P + offs_m
    tok_m = seq0 + offs_m
    q = tl.load(Q + h * stride_qh + tok_m[:, None] * stride_qt + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    ts_i = offs_m
    if HAS_TIME:
        ts_i = tl.load(TS + tok_m, mask=row_ok, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    if HAS_PREFIX:
        acc = _fwd_sweep(acc, q, gi, row_ok, hist, ts_i, KP + h * stride_kph, VP + h * stride_vph, TSP, p0, 0,
                         0, P, stride_kpt, stride_vpt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                         D_QK, D_V, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    # new keys in the history (causal), then the candidates' own diagonal block
    k1_end = tl.maximum(tl.minimum(hist - P, start_m + BLOCK_M), 0)
    acc = _fwd_sweep(acc, q, gi, row_ok, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0, P,
                     0, k1_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                     D_QK, D_V, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    if HAS_TARGETS:
        k2_start = tl.maximum(k1_end, start_m)
        k2_end = tl.minimum(S, start_m + BLOCK_M)
        acc = _fwd_sweep(acc, q, gi, row_ok, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0, P,
                         k2_start, k2_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n,
                         offs_dk, offs_dv, D_QK, D_V, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    tl.store(OUT + h * stride_oh + tok_m[:, None] * stride_ot + offs_dv[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _hstu_bwd_kv(Q, K, V, DO, DK, DV, DPOS, DTIME, seq_offsets, num_targets, TS, pos_w, time_w,
                 tile_seq, tile_blk,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 inv_n, num_pos, num_tb, D_QK, D_V, num_heads,
                 HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                 POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, GRAD_SLOTS: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h32 = tl.program_id(1)
    h = h32.to(tl.int64)
    b = tl.load(tile_seq + pid)
    start_n = tl.load(tile_blk + pid) * BLOCK_N
    seq0 = tl.load(seq_offsets + b).to(tl.int64)
    L = (tl.load(seq_offsets + b + 1) - seq0).to(tl.int32)
    hist = L
    if HAS_TARGETS:
        hist = tl.maximum(L - tl.load(num_targets + b).to(tl.int32), 0)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < L
    tok_n = seq0 + offs_n
    k = tl.load(K + h * stride_kh + tok_n[:, None] * stride_kt + offs_dk[None, :],
                mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    v = tl.load(V + h * stride_vh + tok_n[:, None] * stride_vt + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    ts_j = offs_n
    if HAS_TIME:
        ts_j = tl.load(TS + tok_n, mask=col_ok, other=0)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    slot = (pid * num_heads + h32) % GRAD_SLOTS
    # history keys are seen by every later query; candidate keys only by themselves
    q_end = tl.where(start_n < hist, L, tl.minimum(L, start_n + BLOCK_N))
    for start_m in range(start_n, q_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        tok_m = seq0 + offs_m
        q = tl.load(Q + h * stride_qh + tok_m[:, None] * stride_qt + offs_dk[None, :],
                    mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
        do = tl.load(DO + h * stride_doh + tok_m[:, None] * stride_dot + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_i = offs_m
        if HAS_TIME:
            ts_i = tl.load(TS + tok_m, mask=row_ok, other=0)
        s, allowed, dist, bucket = _scores(q, k, offs_m, offs_n, row_ok, col_ok, hist, ts_i, ts_j, pos_w,
                                           time_w, num_pos, num_tb, HAS_POS, HAS_TIME, UPCAST, PRECISION,
                                           TB_DIV)
        sig = tl.sigmoid(s)
        a = tl.where(allowed, s * sig * inv_n, 0.0)
        dv += mm(tl.trans(a.to(do.dtype)), do, UPCAST, PRECISION)
        da = mm(do, tl.trans(v), UPCAST, PRECISION)
        ds = tl.where(allowed, da * inv_n * sig * (1.0 + s * (1.0 - sig)), 0.0)
        dk += mm(tl.trans(ds.to(q.dtype)), q, UPCAST, PRECISION)
        if POS_GRAD:
            tl.atomic_add(DPOS + slot * num_pos + dist, ds, mask=allowed, sem="relaxed")
        if TIME_GRAD:
            tl.atomic_add(DTIME + slot * (num_tb + 1) + bucket, ds, mask=allowed, sem="relaxed")
    tl.store(DK + h * stride_dkh + tok_n[:, None] * stride_dkt + offs_dk[None, :], dk.to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dk[None, :] < D_QK))
    tl.store(DV + h * stride_dvh + tok_n[:, None] * stride_dvt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _bwd_q_sweep(dq, q, do, gi, row_ok, hist, ts_i, K, V, TS, seq0, lo, hi, stride_kt, stride_vt,
                 pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
                 HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        tok = seq0 + offs_n
        k = tl.load(K + tok[:, None] * stride_kt + offs_dk[None, :],
                    mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
        v = tl.load(V + tok[:, None] * stride_vt + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_j = ts_i
        if HAS_TIME:
            ts_j = tl.load(TS + tok, mask=col_ok, other=0)
        s, allowed, _, _ = _scores(q, k, gi, offs_n, row_ok, col_ok, hist, ts_i, ts_j, pos_w, time_w,
                                   num_pos, num_tb, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV)
        sig = tl.sigmoid(s)
        da = mm(do, tl.trans(v), UPCAST, PRECISION)
        ds = tl.where(allowed, da * inv_n * sig * (1.0 + s * (1.0 - sig)), 0.0)
        dq += mm(ds.to(k.dtype), k, UPCAST, PRECISION)
    return dq


@triton.jit
def _hstu_bwd_q(Q, K, V, DO, DQ, seq_offsets, num_targets, TS, pos_w, time_w, tile_seq, tile_blk,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_dqt, stride_dqh, inv_n, num_pos, num_tb, D_QK, D_V,
                HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, TB_DIV: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tile_seq + pid)
    start_m = tl.load(tile_blk + pid) * BLOCK_M
    seq0 = tl.load(seq_offsets + b).to(tl.int64)
    L = (tl.load(seq_offsets + b + 1) - seq0).to(tl.int32)
    hist = L
    if HAS_TARGETS:
        hist = tl.maximum(L - tl.load(num_targets + b).to(tl.int32), 0)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L
    tok_m = seq0 + offs_m
    q = tl.load(Q + h * stride_qh + tok_m[:, None] * stride_qt + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + h * stride_doh + tok_m[:, None] * stride_dot + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    ts_i = offs_m
    if HAS_TIME:
        ts_i = tl.load(TS + tok_m, mask=row_ok, other=0)
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
    k1_end = tl.minimum(hist, start_m + BLOCK_M)
    dq = _bwd_q_sweep(dq, q, do, offs_m, row_ok, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0,
                      0, k1_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                      D_QK, D_V, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    if HAS_TARGETS:
        k2_start = tl.maximum(k1_end, start_m)
        k2_end = tl.minimum(L, start_m + BLOCK_M)
        dq = _bwd_q_sweep(dq, q, do, offs_m, row_ok, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS,
                          seq0, k2_start, k2_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n,
                          offs_dk, offs_dv, D_QK, D_V, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    tl.store(DQ + h * stride_dqh + tok_m[:, None] * stride_dqt + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < D_QK))


def _blocks(interpreted: bool, d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). Small tiles in the interpreter (numpy per program) keep tests fast."""
    if interpreted:
        return 16, 16, 1
    if d <= 64:
        return 64, 64, 4
    return 64, 32, 4


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _common(q, k, v, timestamps, pos_w, time_w, num_targets):
    interpreted = check_device(_hstu_fwd, q, k, v)
    has_time = time_w is not None and timestamps is not None
    flags = dict(
        HAS_TARGETS=num_targets is not None,
        HAS_POS=pos_w is not None,
        HAS_TIME=has_time,
        UPCAST=interpreted,
        PRECISION=dot_precision(q.dtype),
        TB_DIV=TIME_BUCKET_DIV,
        BLOCK_DQK=block_dim(q.shape[-1]),
        BLOCK_DV=block_dim(v.shape[-1]),
    )
    num_pos = pos_w.numel() if pos_w is not None else 1
    num_tb = time_w.numel() - 1 if has_time else 0
    dummy = q.new_zeros(1)
    tables = (
        pos_w if pos_w is not None else dummy,
        time_w if has_time else dummy,
        timestamps if has_time else dummy,
        num_targets if num_targets is not None else dummy,
    )
    return interpreted, flags, num_pos, num_tb, tables


def _forward(q, k, v, offsets, timestamps, pos_w, time_w, num_targets, max_seq_len,
             k_prefix=None, v_prefix=None, prefix_starts=None, prefix_lengths=None, prefix_timestamps=None):
    interpreted, flags, num_pos, num_tb, (pw, tw, ts, nt) = _common(q, k, v, timestamps, pos_w, time_w,
                                                                     num_targets)
    n_tok, num_heads, _ = q.shape
    out = torch.empty((n_tok, num_heads, v.shape[-1]), dtype=v.dtype, device=v.device)
    if n_tok == 0 or num_heads == 0:
        return out
    block_m, block_n, warps = _blocks(interpreted, max(q.shape[-1], v.shape[-1]))
    lengths = (offsets[1:] - offsets[:-1]).cpu()
    tile_seq, tile_blk = jagged_tiles(lengths, block_m, q.device)
    has_prefix = k_prefix is not None
    kp = k_prefix if has_prefix else k
    vp = v_prefix if has_prefix else v
    tsp = prefix_timestamps if has_prefix and flags["HAS_TIME"] else ts
    _hstu_fwd[(tile_seq.numel(), num_heads)](
        q, k, v, kp, vp, out, offsets, prefix_starts if has_prefix else offsets,
        prefix_lengths if has_prefix else offsets, nt, ts, tsp, pw, tw,
        tile_seq, tile_blk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1), out.stride(0), out.stride(1),
        1.0 / max_seq_len, num_pos, num_tb, q.shape[-1], v.shape[-1],
        HAS_PREFIX=has_prefix, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **flags,
    )
    return out


class _HstuAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, timestamps, pos_w, time_w, num_targets, max_seq_len):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out = _forward(q, k, v, offsets, timestamps, pos_w, time_w, num_targets, max_seq_len)
        ctx.save_for_backward(q, k, v, offsets, timestamps, pos_w, time_w, num_targets)
        ctx.max_seq_len = max_seq_len
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, timestamps, pos_w, time_w, num_targets = ctx.saved_tensors
        dout = _last_dim_contiguous(dout)
        interpreted, flags, num_pos, num_tb, (pw, tw, ts, nt) = _common(q, k, v, timestamps, pos_w, time_w,
                                                                         num_targets)
        pos_grad = pos_w is not None and ctx.needs_input_grad[5]
        time_grad = flags["HAS_TIME"] and ctx.needs_input_grad[6]
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        dpos = torch.zeros((_GRAD_SLOTS, num_pos), dtype=torch.float32, device=q.device) if pos_grad else None
        dtime = (torch.zeros((_GRAD_SLOTS, num_tb + 1), dtype=torch.float32, device=q.device)
                 if time_grad else None)
        n_tok, num_heads, _ = q.shape
        if n_tok and num_heads:
            block_m, block_n, warps = _blocks(interpreted, max(q.shape[-1], v.shape[-1]))
            lengths = (offsets[1:] - offsets[:-1]).cpu()
            seq_n, blk_n = jagged_tiles(lengths, block_n, q.device)
            seq_m, blk_m = (seq_n, blk_n) if block_m == block_n else jagged_tiles(lengths, block_m, q.device)
            inv_n = 1.0 / ctx.max_seq_len
            dummy32 = torch.zeros(1, dtype=torch.float32, device=q.device)
            _hstu_bwd_kv[(seq_n.numel(), num_heads)](
                q, k, v, dout, dk, dv, dpos if pos_grad else dummy32, dtime if time_grad else dummy32,
                offsets, nt, ts, pw, tw, seq_n, blk_n,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                inv_n, num_pos, num_tb, q.shape[-1], v.shape[-1], num_heads,
                POS_GRAD=pos_grad, TIME_GRAD=time_grad, GRAD_SLOTS=_GRAD_SLOTS,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **flags,
            )
            _hstu_bwd_q[(seq_m.numel(), num_heads)](
                q, k, v, dout, dq, offsets, nt, ts, pw, tw, seq_m, blk_m,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                inv_n, num_pos, num_tb, q.shape[-1], v.shape[-1],
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, **flags,
            )
        dpos_w = dpos.sum(0).to(pos_w.dtype) if pos_grad else None
        dtime_w = dtime.sum(0).to(time_w.dtype) if time_grad else None
        return dq, dk, dv, None, None, dpos_w, dtime_w, None, None


def hstu_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused jagged HSTU attention; differentiable in q, k, v, pos_weight and time_weight."""
    return _HstuAttention.apply(q, k, v, offsets, timestamps, pos_weight, time_weight, num_targets, max_seq_len)


def hstu_attention_with_prefix_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_offsets: torch.Tensor | None = None,
    *,
    prefix_starts: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    max_seq_len: int,
    timestamps: torch.Tensor | None = None,
    prefix_timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward only (serving): new tokens attend to their sequence's cached prefix K/V and to themselves.

    Sequence b's prefix is tokens ``prefix_starts[b] .. prefix_starts[b] + prefix_lengths[b] - 1`` of
    ``k_prefix``/``v_prefix`` [T, H, d] (and ``prefix_timestamps`` [T]): ranges may be in any order, with gaps
    (a KV arena holding many users' prefixes, read in place). ``prefix_offsets`` [B + 1] is the jagged
    special case (prefixes concatenated in batch order) and is used when the two are not given.
    """
    if time_weight is not None and timestamps is not None and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    if prefix_starts is None or prefix_lengths is None:
        if prefix_offsets is None:
            raise ValueError("give prefix_offsets, or prefix_starts and prefix_lengths")
        prefix_starts, prefix_lengths = prefix_offsets[:-1], prefix_offsets[1:] - prefix_offsets[:-1]
    with torch.no_grad():
        q, k, v, k_prefix, v_prefix = (_last_dim_contiguous(t) for t in (q, k, v, k_prefix, v_prefix))
        return _forward(q, k, v, offsets, timestamps, pos_weight, time_weight, num_targets, max_seq_len,
                        k_prefix=k_prefix, v_prefix=v_prefix, prefix_starts=prefix_starts,
                        prefix_lengths=prefix_lengths, prefix_timestamps=prefix_timestamps)

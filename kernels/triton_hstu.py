"""Fused jagged HSTU attention in Triton: forward, backward, and the cached-prefix (serving) forward.

The math is exactly :mod:`grstack.kernels.reference`'s. Programs are launched over (jagged tile, head),
where a tile is ``BLOCK`` consecutive tokens of one sequence (see :func:`triton_util.jagged_tiles`): no
padding to L_max and no [B, L, L] tensor — Q·Kᵀ, the position/time bias (gathered from the two small
weight tables by in-kernel indices), SiLU, the mask, the 1/N scale and ·V happen in registers.

Key loops visit only blocks that can hold allowed pairs: for queries in the history, keys up to the
diagonal; for candidate queries (``num_targets``), the history plus their own diagonal block.

Blocks wholly below the diagonal and in the history skip the mask (only diagonal and candidate blocks need
it); keys past a range load as zeros and add nothing, so validity masks sit on loads only.

Backward: one kernel over key tiles computes dK, dV and the bias-table gradients, key-major (scores are
[keys, queries], so no register tile is transposed); every (i, j) pair is visited exactly once there and
the table gradients are reduced inside each program and written once, with no atomics (deterministic; see
:func:`_hstu_bwd_kv`). A second kernel over query tiles computes dQ.

Tiles and warps come from :mod:`grstack.kernels.triton_tuning` (spill-free candidates, autotuned on CUDA);
the tile list is built on the device (no host sync).

Serving: query tokens are positions ``P..P+S-1`` of a sequence whose first ``P`` tokens' K/V are cached;
the same forward kernel first sweeps the cached prefix (all of it is visible to every new token), then the
new tokens' own K/V causally.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from grstack.kernels.bias import TIME_BUCKET_DIV
from grstack.kernels.triton_tuning import TileConfig, TuneKey, max_len_bucket, run_tuned
from grstack.kernels.triton_util import block_dim, check_device, dot_precision, jagged_tiles, mm


@triton.jit
def _allowed(gi, gj, hist):
    """Allowed (query, key) pairs by position: causal, and candidate keys only for themselves. Arguments are
    broadcastable 2-D index tensors (queries as rows, or as columns in the key-major backward)."""
    return (gj <= gi) & ((gj < hist) | (gj == gi))


@triton.jit
def _pos_index(gi, gj, hist, num_pos):
    """Relative-position table index: candidates all sit at position ``hist``."""
    return tl.minimum(tl.maximum(tl.minimum(gi, hist) - tl.minimum(gj, hist), 0), num_pos - 1)


@triton.jit
def _time_index(ts_i, ts_j, num_tb, TB_DIV: tl.constexpr):
    """Time-bucket table index (:func:`grstack.kernels.bias.time_buckets`) of the query and key times."""
    dt = tl.maximum(tl.abs(ts_i - ts_j), 1).to(tl.float32)
    return tl.minimum(tl.maximum(tl.floor(tl.log(dt) / TB_DIV), 0.0), num_tb).to(tl.int32)


@triton.jit
def _biased(s, gi, gj, hist, ts_i, ts_j, pos_w, time_w, num_pos, num_tb,
            HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, TB_DIV: tl.constexpr):
    if HAS_POS:
        s += tl.load(pos_w + _pos_index(gi, gj, hist, num_pos)).to(tl.float32)
    if HAS_TIME:
        s += tl.load(time_w + _time_index(ts_i, ts_j, num_tb, TB_DIV)).to(tl.float32)
    return s


@triton.jit
def _fwd_sweep(acc, q, gi, hist, ts_i, K, V, TSK, key_tok0, gpos0, lo, hi, stride_kt, stride_vt,
               pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
               MASKED: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, UPCAST: tl.constexpr,
               PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_N: tl.constexpr, SEMANTIC: tl.constexpr):
    """acc += A[:, lo:hi] @ V[lo:hi] for one key range; K/V/TSK point at this head's token 0.

    ``SEMANTIC`` False: a bias-only channel (FuXi-α), ``A = bias ⊙ mask`` with no q·k, SiLU or 1/N.

    Keys past ``hi`` load as zeros (their values add nothing); ``MASKED`` applies the causal/candidate
    structure, which only blocks on the diagonal or holding candidates need.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        tok = (key_tok0 + offs_n).to(tl.int64)
        v = tl.load(V + tok[:, None] * stride_vt + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_j = offs_n
        if HAS_TIME:
            ts_j = tl.load(TSK + tok, mask=col_ok, other=0)
        gj = gpos0 + offs_n
        if SEMANTIC:
            k = tl.load(K + tok[:, None] * stride_kt + offs_dk[None, :],
                        mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
            s = mm(q, tl.trans(k), UPCAST, PRECISION)
        else:
            s = (gi[:, None] * 0 + gj[None, :] * 0).to(tl.float32)
        s = _biased(s, gi[:, None], gj[None, :], hist, ts_i[:, None], ts_j[None, :], pos_w, time_w, num_pos, num_tb,
                    HAS_POS, HAS_TIME, TB_DIV)
        a = s
        if SEMANTIC:
            a = s * tl.sigmoid(s) * inv_n
        if MASKED:
            a = tl.where(_allowed(gi[:, None], gj[None, :], hist), a, 0.0)
        acc += mm(a.to(v.dtype), v, UPCAST, PRECISION)
    return acc


@triton.jit
def _hstu_fwd(Q, K, V, KP, VP, OUT, seq_offsets, prefix_starts, prefix_lengths, num_targets, TS, TSQ, TSP,
              pos_w, time_w, tile_seq, tile_blk,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_kpt, stride_kph, stride_vpt, stride_vph, stride_ot, stride_oh,
              inv_n, num_pos, num_tb, D_QK, D_V,
              HAS_PREFIX: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr,
              HAS_TIME: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, TB_DIV: tl.constexpr,
              BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SEMANTIC: tl.constexpr = True):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tile_seq + pid)
    if b < 0:
        return
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
    q = offs_m
    if SEMANTIC:
        q = tl.load(Q + h * stride_qh + tok_m[:, None] * stride_qt + offs_dk[None, :],
                    mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    ts_i = offs_m
    if HAS_TIME:
        ts_i = tl.load(TSQ + tok_m, mask=row_ok, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    if HAS_PREFIX:
        # every cached token is history before every new token: no structural mask
        acc = _fwd_sweep(acc, q, gi, hist, ts_i, KP + h * stride_kph, VP + h * stride_vph, TSP, p0, 0,
                         0, P, stride_kpt, stride_vpt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                         D_QK, D_V, False, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N, SEMANTIC)
    # new keys in the history: whole blocks below the diagonal unmasked, then the diagonal blocks masked;
    # then the candidates' own diagonal block
    k1_end = tl.maximum(tl.minimum(hist - P, start_m + BLOCK_M), 0)
    mid = tl.maximum(tl.minimum(start_m, hist - P), 0) // BLOCK_N * BLOCK_N
    acc = _fwd_sweep(acc, q, gi, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0, P,
                     0, mid, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                     D_QK, D_V, False, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N, SEMANTIC)
    acc = _fwd_sweep(acc, q, gi, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0, P,
                     mid, k1_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
                     D_QK, D_V, True, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N, SEMANTIC)
    if HAS_TARGETS:
        k2_start = tl.maximum(k1_end, start_m)
        k2_end = tl.minimum(S, start_m + BLOCK_M)
        acc = _fwd_sweep(acc, q, gi, hist, ts_i, K + h * stride_kh, V + h * stride_vh, TS, seq0, P,
                         k2_start, k2_end, stride_kt, stride_vt, pos_w, time_w, num_pos, num_tb, inv_n,
                         offs_dk, offs_dv, D_QK, D_V, True, HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N,
                         SEMANTIC)
    tl.store(OUT + h * stride_oh + tok_m[:, None] * stride_ot + offs_dv[None, :], acc.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _bwd_kv_sweep(dk, dv, cand, scal0, scalc, th, k, v, gj, start_n, hist, ts_j, Q, DO, TSQ, seq0, lo, hi, end,
                  stride_qt, stride_dot, PPLANE, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
                  MASKED: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, HAS_TARGETS: tl.constexpr,
                  POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  TB_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TB: tl.constexpr,
                  SEMANTIC: tl.constexpr):
    """Key-major: scores are [keys, queries], so dV += Aᵀ·dO and dK += dSᵀ·Q need no register transposes.

    Bias-table gradients are reduced in the program, without atomics (see :func:`_hstu_bwd_kv`).
    """
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < end
        tok_m = seq0 + offs_m
        do = tl.load(DO + tok_m[:, None] * stride_dot + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_i = offs_m
        if HAS_TIME:
            ts_i = tl.load(TSQ + tok_m, mask=row_ok, other=0)
        if SEMANTIC:
            q = tl.load(Q + tok_m[:, None] * stride_qt + offs_dk[None, :],
                        mask=row_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
            s = mm(k, tl.trans(q), UPCAST, PRECISION)
        else:
            s = (offs_m[None, :] * 0 + gj[:, None] * 0).to(tl.float32)
        if HAS_POS:
            s += tl.load(pos_w + _pos_index(offs_m[None, :], gj[:, None], hist, num_pos)).to(tl.float32)
        if HAS_TIME:
            tidx = _time_index(ts_i[None, :], ts_j[:, None], num_tb, TB_DIV)
            s += tl.load(time_w + tidx).to(tl.float32)
        da = mm(v, tl.trans(do), UPCAST, PRECISION)
        a = s
        ds = da
        if SEMANTIC:
            sig = tl.sigmoid(s)
            a = s * sig * inv_n
            ds = da * inv_n * sig * (1.0 + s * (1.0 - sig))
        if MASKED:
            ok = _allowed(offs_m[None, :], gj[:, None], hist)
            a = tl.where(ok, a, 0.0)
            ds = tl.where(ok, ds, 0.0)
        dv += mm(a.to(do.dtype), do, UPCAST, PRECISION)
        if SEMANTIC:
            dk += mm(ds.to(q.dtype), q, UPCAST, PRECISION)
        if POS_GRAD:
            hq = offs_m[None, :] < hist
            hk = gj[:, None] < hist
            dist = offs_m[None, :] - gj[:, None]
            regular = hq & hk & (dist < num_pos - 1)
            scalc += tl.sum(tl.where(hq & hk & (dist >= num_pos - 1), ds, 0.0))
            if HAS_TARGETS:
                cand += tl.sum(tl.where(hk & (offs_m[None, :] >= hist), ds, 0.0), axis=1)
                scal0 += tl.sum(tl.where(gj[:, None] >= hist, ds, 0.0))
            # diagonal sums: rotate row jj left by jj, so column c holds the pairs with i - j = c (or c - BM)
            jj = tl.arange(0, BLOCK_N)[:, None]
            cc = tl.arange(0, BLOCK_M)[None, :]
            rot = tl.gather(tl.where(regular, ds, 0.0), (jj + cc) % BLOCK_M, axis=1)
            wrap = jj + cc >= BLOCK_M
            base = start_m - start_n
            pc = tl.arange(0, BLOCK_M)
            tl.store(PPLANE + base + pc, tl.sum(tl.where(wrap, 0.0, rot), axis=0), mask=base + pc < num_pos)
            lo_p = base - BLOCK_M + pc
            tl.store(PPLANE + num_pos + lo_p, tl.sum(tl.where(wrap, rot, 0.0), axis=0),
                     mask=(lo_p >= 0) & (lo_p < num_pos))
        if TIME_GRAD:
            nz = ds != 0.0
            b_lo = tl.min(tl.where(nz, tidx, num_tb + 1))
            b_hi = tl.max(tl.where(nz, tidx, -1))
            tb = tl.arange(0, BLOCK_TB)
            for bucket in range(b_lo, b_hi + 1):
                th += tl.where(tb == bucket, tl.sum(tl.where(tidx == bucket, ds, 0.0)), 0.0)
    return dk, dv, cand, scal0, scalc, th


@triton.jit
def _hstu_bwd_kv(Q, K, V, DO, DK, DV, DPOS_PART, DPOS_SCAL, DTIME_PART, seq_offsets, num_targets, TS, TSQ,
                 pos_w, time_w, tile_seq, tile_blk,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 inv_n, num_pos, num_tb, D_QK, D_V, num_heads,
                 HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                 POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_TB: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SEMANTIC: tl.constexpr = True):
    """dK, dV of one key tile and head (``SEMANTIC`` False: dV of a bias-only channel, no dK); with table gradients, this program's partial sums of them.

    Position table: a query tile at distance ``base`` from the key tile holds the distances ``base + r``,
    ``r`` in ``(-BLOCK_N, BLOCK_M)``; its diagonal sums (one rotation and two column sums) are written once
    to plane 0 (``r >= 0``) and plane 1 (``r < 0``) of this program's row of ``DPOS_PART`` [rows, 3, num_pos]
    (``BLOCK_M >= BLOCK_N`` keeps every position of a plane written by one query tile only); candidate
    queries (all at position ``hist``) go to plane 2 per key, and distance 0 of candidate keys and distances
    clamped to the table's end to ``DPOS_SCAL`` [rows, 2]. Time table: per tile, a loop over the buckets
    present adds each bucket's sum to a register histogram, written once to ``DTIME_PART`` [rows, BLOCK_TB].
    The host sums the rows: no atomics, the same result on every run.
    """
    pid = tl.program_id(0)
    h32 = tl.program_id(1)
    h = h32.to(tl.int64)
    b = tl.load(tile_seq + pid)
    if b < 0:
        return
    if POS_GRAD:
        tl.static_assert(BLOCK_M >= BLOCK_N, "position-table gradients need BLOCK_M >= BLOCK_N")
    row = pid.to(tl.int64) * num_heads + h
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
    k = offs_n
    if SEMANTIC:
        k = tl.load(K + h * stride_kh + tok_n[:, None] * stride_kt + offs_dk[None, :],
                    mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
    v = tl.load(V + h * stride_vh + tok_n[:, None] * stride_vt + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    ts_j = offs_n
    if HAS_TIME:
        ts_j = tl.load(TS + tok_n, mask=col_ok, other=0)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    cand = tl.zeros((BLOCK_N,), dtype=tl.float32)
    th = tl.zeros((BLOCK_TB,), dtype=tl.float32)
    scal0 = 0.0
    scalc = 0.0
    pplane = DPOS_PART + row * 3 * num_pos
    # history keys are seen by every later query; candidate keys only by themselves. Query blocks that start
    # at or past the end of this key block see all of it when it is all history (no structural mask).
    q_end = tl.where(start_n < hist, L, tl.minimum(L, start_n + BLOCK_N))
    diag_end = tl.minimum(start_n + (BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q_end)
    all_hist = start_n + BLOCK_N <= hist
    Qh = Q + h * stride_qh
    DOh = DO + h * stride_doh
    dk, dv, cand, scal0, scalc, th = _bwd_kv_sweep(
        dk, dv, cand, scal0, scalc, th, k, v, offs_n, start_n, hist, ts_j, Qh, DOh, TSQ, seq0, start_n, diag_end,
        L, stride_qt, stride_dot, pplane, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
        True, HAS_POS, HAS_TIME, HAS_TARGETS, POS_GRAD, TIME_GRAD, UPCAST, PRECISION, TB_DIV, BLOCK_M, BLOCK_N,
        BLOCK_TB, SEMANTIC)
    dk, dv, cand, scal0, scalc, th = _bwd_kv_sweep(
        dk, dv, cand, scal0, scalc, th, k, v, offs_n, start_n, hist, ts_j, Qh, DOh, TSQ, seq0, diag_end,
        tl.where(all_hist, q_end, diag_end), L, stride_qt, stride_dot, pplane, pos_w, time_w, num_pos, num_tb,
        inv_n, offs_dk, offs_dv, D_QK, D_V, False, HAS_POS, HAS_TIME, HAS_TARGETS, POS_GRAD, TIME_GRAD, UPCAST,
        PRECISION, TB_DIV, BLOCK_M, BLOCK_N, BLOCK_TB, SEMANTIC)
    dk, dv, cand, scal0, scalc, th = _bwd_kv_sweep(
        dk, dv, cand, scal0, scalc, th, k, v, offs_n, start_n, hist, ts_j, Qh, DOh, TSQ, seq0, diag_end,
        tl.where(all_hist, diag_end, q_end), L, stride_qt, stride_dot, pplane, pos_w, time_w, num_pos, num_tb,
        inv_n, offs_dk, offs_dv, D_QK, D_V, True, HAS_POS, HAS_TIME, HAS_TARGETS, POS_GRAD, TIME_GRAD, UPCAST,
        PRECISION, TB_DIV, BLOCK_M, BLOCK_N, BLOCK_TB, SEMANTIC)
    if SEMANTIC:
        tl.store(DK + h * stride_dkh + tok_n[:, None] * stride_dkt + offs_dk[None, :], dk.to(DK.dtype.element_ty),
                 mask=col_ok[:, None] & (offs_dk[None, :] < D_QK))
    tl.store(DV + h * stride_dvh + tok_n[:, None] * stride_dvt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < D_V))
    if POS_GRAD:
        if HAS_TARGETS:
            pc = hist - offs_n  # candidate queries sit at position hist: distance hist - j
            hk = offs_n < hist
            tl.store(pplane + 2 * num_pos + pc, cand, mask=hk & (pc < num_pos - 1))
            scalc += tl.sum(tl.where(hk & (pc >= num_pos - 1), cand, 0.0))
        tl.store(DPOS_SCAL + row * 2, scal0)
        tl.store(DPOS_SCAL + row * 2 + 1, scalc)
    if TIME_GRAD:
        tb = tl.arange(0, BLOCK_TB)
        tl.store(DTIME_PART + row * BLOCK_TB + tb, th, mask=tb <= num_tb)


@triton.jit
def _bwd_q_sweep(dq, q, do, gi, hist, ts_i, K, V, TS, seq0, lo, hi, stride_kt, stride_vt,
                 pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V,
                 MASKED: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < hi
        tok = seq0 + offs_n
        k = tl.load(K + tok[:, None] * stride_kt + offs_dk[None, :],
                    mask=col_ok[:, None] & (offs_dk[None, :] < D_QK), other=0.0)
        v = tl.load(V + tok[:, None] * stride_vt + offs_dv[None, :],
                    mask=col_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        ts_j = offs_n
        if HAS_TIME:
            ts_j = tl.load(TS + tok, mask=col_ok, other=0)
        s = _biased(mm(q, tl.trans(k), UPCAST, PRECISION), gi[:, None], offs_n[None, :], hist, ts_i[:, None],
                    ts_j[None, :], pos_w, time_w, num_pos, num_tb, HAS_POS, HAS_TIME, TB_DIV)
        sig = tl.sigmoid(s)
        da = mm(do, tl.trans(v), UPCAST, PRECISION)
        ds = da * inv_n * sig * (1.0 + s * (1.0 - sig))
        if MASKED:
            ds = tl.where(_allowed(gi[:, None], offs_n[None, :], hist), ds, 0.0)
        dq += mm(ds.to(k.dtype), k, UPCAST, PRECISION)
    return dq


@triton.jit
def _hstu_bwd_q(Q, K, V, DO, DQ, seq_offsets, num_targets, TS, TSQ, pos_w, time_w, tile_seq, tile_blk,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                stride_dqt, stride_dqh, inv_n, num_pos, num_tb, D_QK, D_V,
                HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, TB_DIV: tl.constexpr,
                BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.load(tile_seq + pid)
    if b < 0:
        return
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
        ts_i = tl.load(TSQ + tok_m, mask=row_ok, other=0)
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
    k1_end = tl.minimum(hist, start_m + BLOCK_M)
    mid = tl.maximum(tl.minimum(start_m, hist), 0) // BLOCK_N * BLOCK_N
    Kh = K + h * stride_kh
    Vh = V + h * stride_vh
    dq = _bwd_q_sweep(dq, q, do, offs_m, hist, ts_i, Kh, Vh, TS, seq0, 0, mid, stride_kt, stride_vt,
                      pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V, False,
                      HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    dq = _bwd_q_sweep(dq, q, do, offs_m, hist, ts_i, Kh, Vh, TS, seq0, mid, k1_end, stride_kt, stride_vt,
                      pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V, True,
                      HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    if HAS_TARGETS:
        k2_start = tl.maximum(k1_end, start_m)
        k2_end = tl.minimum(L, start_m + BLOCK_M)
        dq = _bwd_q_sweep(dq, q, do, offs_m, hist, ts_i, Kh, Vh, TS, seq0, k2_start, k2_end, stride_kt,
                          stride_vt, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv, D_QK, D_V, True,
                          HAS_POS, HAS_TIME, UPCAST, PRECISION, TB_DIV, BLOCK_N)
    tl.store(DQ + h * stride_dqh + tok_m[:, None] * stride_dqt + offs_dk[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < D_QK))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _common(q, k, v, timestamps, query_timestamps, pos_w, time_w, num_targets):
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
    ts = timestamps if has_time else dummy
    tables = (
        pos_w if pos_w is not None else dummy,
        time_w if has_time else dummy,
        ts,
        query_timestamps if has_time and query_timestamps is not None else ts,
        num_targets if num_targets is not None else dummy,
    )
    return interpreted, flags, num_pos, num_tb, tables


def _features(flags: dict, **extra: bool) -> tuple[str, ...]:
    names = ("HAS_TARGETS", "HAS_POS", "HAS_TIME", *extra)
    return tuple(n for n in names if {**flags, **extra}.get(n))


def _forward(q, k, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets, max_seq_len,
             k_prefix=None, v_prefix=None, prefix_starts=None, prefix_lengths=None, prefix_timestamps=None,
             semantic: bool = True):
    interpreted, flags, num_pos, num_tb, (pw, tw, ts, tsq, nt) = _common(
        q, k, v, timestamps, query_timestamps, pos_w, time_w, num_targets)
    n_tok, num_heads, _ = q.shape
    out = torch.empty((n_tok, num_heads, v.shape[-1]), dtype=v.dtype, device=v.device)
    if n_tok == 0 or num_heads == 0:
        return out
    has_prefix = k_prefix is not None
    kp = k_prefix if has_prefix else k
    vp = v_prefix if has_prefix else v
    tsp = prefix_timestamps if has_prefix and flags["HAS_TIME"] else ts

    def launch(cfg: TileConfig) -> None:
        tile_seq, tile_blk = jagged_tiles(offsets, n_tok, cfg.block_m)
        _hstu_fwd[(tile_seq.numel(), num_heads)](
            q, k, v, kp, vp, out, offsets, prefix_starts if has_prefix else offsets,
            prefix_lengths if has_prefix else offsets, nt, ts, tsq, tsp, pw, tw,
            tile_seq, tile_blk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1), out.stride(0), out.stride(1),
            1.0 / max_seq_len, num_pos, num_tb, q.shape[-1], v.shape[-1],
            HAS_PREFIX=has_prefix, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, SEMANTIC=semantic, **flags,
        )

    key = TuneKey("fwd", str(q.dtype), flags["BLOCK_DQK"], flags["BLOCK_DV"], num_heads,
                  _features(flags, HAS_PREFIX=has_prefix, CHANNEL=not semantic), max_len_bucket(max_seq_len))
    run_tuned(key, interpreted, launch)
    return out


class _HstuAttention(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, q, k, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets, max_seq_len):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out = _forward(q, k, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets, max_seq_len)
        ctx.save_for_backward(q, k, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets)
        ctx.max_seq_len = max_seq_len
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        q, k, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets = ctx.saved_tensors
        dout = _last_dim_contiguous(dout).to(v.dtype)
        interpreted, flags, num_pos, num_tb, (pw, tw, ts, tsq, nt) = _common(
            q, k, v, timestamps, query_timestamps, pos_w, time_w, num_targets)
        pos_grad = pos_w is not None and ctx.needs_input_grad[6]
        time_grad = flags["HAS_TIME"] and ctx.needs_input_grad[7]
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        n_tok, num_heads, _ = q.shape
        block_tb = triton.next_power_of_2(num_tb + 1)
        parts: dict[str, torch.Tensor] = {}
        if n_tok and num_heads:
            inv_n = 1.0 / ctx.max_seq_len
            dummy32 = torch.zeros(1, dtype=torch.float32, device=q.device)

            def launch_kv(cfg: TileConfig) -> None:
                if pos_grad and cfg.block_m < cfg.block_n:  # the diagonal sums need BLOCK_M >= BLOCK_N
                    cfg = dataclasses.replace(cfg, block_m=cfg.block_n)
                seq_n, blk_n = jagged_tiles(offsets, n_tok, cfg.block_n)
                rows = seq_n.numel() * num_heads
                f32 = dict(dtype=torch.float32, device=q.device)
                parts.update(
                    pos=torch.zeros((rows, 3, num_pos), **f32) if pos_grad else dummy32,
                    pos_scal=torch.zeros((rows, 2), **f32) if pos_grad else dummy32,
                    time=torch.zeros((rows, block_tb), **f32) if time_grad else dummy32)
                _hstu_bwd_kv[(seq_n.numel(), num_heads)](
                    q, k, v, dout, dk, dv, parts["pos"], parts["pos_scal"], parts["time"],
                    offsets, nt, ts, tsq, pw, tw, seq_n, blk_n,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                    inv_n, num_pos, num_tb, q.shape[-1], v.shape[-1], num_heads,
                    POS_GRAD=pos_grad, TIME_GRAD=time_grad, BLOCK_TB=block_tb,
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, **flags,
                )

            def launch_q(cfg: TileConfig) -> None:
                seq_m, blk_m = jagged_tiles(offsets, n_tok, cfg.block_m)
                _hstu_bwd_q[(seq_m.numel(), num_heads)](
                    q, k, v, dout, dq, offsets, nt, ts, tsq, pw, tw, seq_m, blk_m,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                    inv_n, num_pos, num_tb, q.shape[-1], v.shape[-1],
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, **flags,
                )

            common = (str(q.dtype), flags["BLOCK_DQK"], flags["BLOCK_DV"], num_heads)
            bucket = max_len_bucket(ctx.max_seq_len)
            run_tuned(TuneKey("bwd_kv", *common, _features(flags, POS_GRAD=pos_grad, TIME_GRAD=time_grad),
                              bucket), interpreted, launch_kv)
            run_tuned(TuneKey("bwd_q", *common, _features(flags), bucket), interpreted, launch_q)
        else:
            dq.zero_()
            dk.zero_()
            dv.zero_()
        dpos_w = dtime_w = None
        if pos_grad:
            dpos_w = torch.zeros(num_pos, dtype=torch.float32, device=q.device)
            if "pos" in parts:
                dpos_w += parts["pos"].sum(dim=(0, 1))
                dpos_w[0] += parts["pos_scal"][:, 0].sum()
                dpos_w[num_pos - 1] += parts["pos_scal"][:, 1].sum()
            dpos_w = dpos_w.to(pos_w.dtype)
        if time_grad:
            dtime_w = (parts["time"].sum(0)[:num_tb + 1] if "time" in parts
                       else torch.zeros(num_tb + 1, dtype=torch.float32, device=q.device)).to(time_w.dtype)
        return dq, dk, dv, None, None, None, dpos_w, dtime_w, None, None


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
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused jagged HSTU attention; differentiable in q, k, v, pos_weight and time_weight.

    ``query_timestamps`` [sum_L]: the time each token queries at (the time bias buckets
    ``query_timestamps[i] - timestamps[j]``); None: its own timestamp. Under CUDA autocast q, k and v run in
    the autocast dtype (bf16 operands, fp32 accumulation) and the output has that dtype.
    """
    if torch.is_autocast_enabled("cuda") and q.is_cuda:
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(dtype) for t in (q, k, v))
    return _HstuAttention.apply(q, k, v, offsets, timestamps, query_timestamps, pos_weight, time_weight,
                                num_targets, max_seq_len)


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
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward only (serving): new tokens attend to their sequence's cached prefix K/V and to themselves.

    Sequence b's prefix is tokens ``prefix_starts[b] .. prefix_starts[b] + prefix_lengths[b] - 1`` of
    ``k_prefix``/``v_prefix`` [T, H, d] (and ``prefix_timestamps`` [T]): ranges may be in any order, with gaps
    (a KV arena holding many users' prefixes, read in place). ``prefix_offsets`` [B + 1] is the jagged
    special case (prefixes concatenated in batch order) and is used when the two are not given.
    ``query_timestamps`` [sum_S]: the new tokens' query times (see :func:`hstu_attention_triton`).
    """
    if time_weight is not None and timestamps is not None and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    if prefix_starts is None or prefix_lengths is None:
        if prefix_offsets is None:
            raise ValueError("give prefix_offsets, or prefix_starts and prefix_lengths")
        prefix_starts, prefix_lengths = prefix_offsets[:-1], prefix_offsets[1:] - prefix_offsets[:-1]
    with torch.no_grad():
        q, k, v, k_prefix, v_prefix = (_last_dim_contiguous(t) for t in (q, k, v, k_prefix, v_prefix))
        return _forward(q, k, v, offsets, timestamps, query_timestamps, pos_weight, time_weight, num_targets,
                        max_seq_len,
                        k_prefix=k_prefix, v_prefix=v_prefix, prefix_starts=prefix_starts,
                        prefix_lengths=prefix_lengths, prefix_timestamps=prefix_timestamps)


class _BiasChannel(torch.autograd.Function):
    """FuXi-α's bias-only channel: the attention kernels with ``SEMANTIC=False`` (no q·k, SiLU or 1/N)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, v, offsets, timestamps, pos_w, time_w, num_targets, max_seq_len, query_timestamps):
        v = _last_dim_contiguous(v)
        out = _forward(v, v, v, offsets, timestamps, query_timestamps, pos_w, time_w, num_targets, max_seq_len,
                       semantic=False)
        ctx.save_for_backward(v, offsets, timestamps, pos_w, time_w, num_targets, query_timestamps)
        ctx.max_seq_len = max_seq_len
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        v, offsets, timestamps, pos_w, time_w, num_targets, query_timestamps = ctx.saved_tensors
        dout = _last_dim_contiguous(dout).to(v.dtype)
        interpreted, flags, num_pos, num_tb, (pw, tw, ts, tsq, nt) = _common(
            v, v, v, timestamps, query_timestamps, pos_w, time_w, num_targets)
        pos_grad = pos_w is not None and ctx.needs_input_grad[3]
        time_grad = flags["HAS_TIME"] and ctx.needs_input_grad[4]
        dv = torch.zeros_like(v)
        n_tok, num_heads, _ = v.shape
        block_tb = triton.next_power_of_2(num_tb + 1)
        parts: dict[str, torch.Tensor] = {}
        if n_tok and num_heads:
            dummy32 = torch.zeros(1, dtype=torch.float32, device=v.device)

            def launch(cfg: TileConfig) -> None:
                if pos_grad and cfg.block_m < cfg.block_n:
                    cfg = dataclasses.replace(cfg, block_m=cfg.block_n)
                seq_n, blk_n = jagged_tiles(offsets, n_tok, cfg.block_n)
                rows = seq_n.numel() * num_heads
                f32 = dict(dtype=torch.float32, device=v.device)
                parts.update(
                    pos=torch.zeros((rows, 3, num_pos), **f32) if pos_grad else dummy32,
                    pos_scal=torch.zeros((rows, 2), **f32) if pos_grad else dummy32,
                    time=torch.zeros((rows, block_tb), **f32) if time_grad else dummy32)
                _hstu_bwd_kv[(seq_n.numel(), num_heads)](
                    v, v, v, dout, dv, dv, parts["pos"], parts["pos_scal"], parts["time"],
                    offsets, nt, ts, tsq, pw, tw, seq_n, blk_n,
                    v.stride(0), v.stride(1), v.stride(0), v.stride(1), v.stride(0), v.stride(1),
                    dout.stride(0), dout.stride(1), dv.stride(0), dv.stride(1), dv.stride(0), dv.stride(1),
                    1.0, num_pos, num_tb, v.shape[-1], v.shape[-1], num_heads,
                    POS_GRAD=pos_grad, TIME_GRAD=time_grad, BLOCK_TB=block_tb,
                    BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, SEMANTIC=False, **flags,
                )

            key = TuneKey("bwd_kv", str(v.dtype), flags["BLOCK_DQK"], flags["BLOCK_DV"], num_heads,
                          _features(flags, POS_GRAD=pos_grad, TIME_GRAD=time_grad, CHANNEL=True),
                          max_len_bucket(ctx.max_seq_len))
            run_tuned(key, interpreted, launch)
        dpos_w = dtime_w = None
        if pos_grad:
            dpos_w = torch.zeros(num_pos, dtype=torch.float32, device=v.device)
            if "pos" in parts:
                dpos_w += parts["pos"].sum(dim=(0, 1))
                dpos_w[0] += parts["pos_scal"][:, 0].sum()
                dpos_w[num_pos - 1] += parts["pos_scal"][:, 1].sum()
            dpos_w = dpos_w.to(pos_w.dtype)
        if time_grad:
            dtime_w = (parts["time"].sum(0)[:num_tb + 1] if "time" in parts
                       else torch.zeros(num_tb + 1, dtype=torch.float32, device=v.device)).to(time_w.dtype)
        return dv, None, None, dpos_w, dtime_w, None, None, None


def bias_channel_triton(v: torch.Tensor, offsets: torch.Tensor, *, max_seq_len: int,
                        pos_weight: torch.Tensor | None = None, time_weight: torch.Tensor | None = None,
                        timestamps: torch.Tensor | None = None,
                        num_targets: torch.Tensor | None = None,
                        query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
    """FuXi-α's bias-only channel (:mod:`grstack.kernels.fuxi`), fused; differentiable in v and the tables.
    ``query_timestamps``: as :func:`hstu_attention_triton`'s."""
    if torch.is_autocast_enabled("cuda") and v.is_cuda:
        v = v.to(torch.get_autocast_dtype("cuda"))
    return _BiasChannel.apply(v, offsets, timestamps, pos_weight, time_weight, num_targets, max_seq_len,
                              query_timestamps)


def bias_channel_with_prefix_triton(v: torch.Tensor, offsets: torch.Tensor, v_prefix: torch.Tensor,
                                    prefix_offsets: torch.Tensor, *, max_seq_len: int,
                                    pos_weight: torch.Tensor | None = None, time_weight: torch.Tensor | None = None,
                                    timestamps: torch.Tensor | None = None,
                                    prefix_timestamps: torch.Tensor | None = None,
                                    num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Serving: the bias-only channel for new tokens after cached prefixes (``v_prefix`` [T, H, dv] jagged by
    ``prefix_offsets``), forward only."""
    with torch.no_grad():
        v, v_prefix = _last_dim_contiguous(v), _last_dim_contiguous(v_prefix)
        return _forward(v, v, v, offsets, timestamps, None, pos_weight, time_weight, num_targets, max_seq_len,
                        k_prefix=v_prefix, v_prefix=v_prefix, prefix_starts=prefix_offsets[:-1],
                        prefix_lengths=prefix_offsets[1:] - prefix_offsets[:-1],
                        prefix_timestamps=prefix_timestamps, semantic=False)

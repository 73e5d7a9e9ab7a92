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
the table gradients are reduced inside each program into its own row of partials, with no atomics
(deterministic), over a bounded number of programs that each loop over several key tiles, so the partials
do not grow with tiles x heads (see :func:`_hstu_bwd_kv`). A second kernel over query tiles computes dQ.

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
from grstack.kernels.inputs import AttentionInputs
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
            # read-modify-write of this program's own row: within one key tile each position of a plane is
            # written by one query tile only; earlier key tiles' writes are behind the barrier in _hstu_bwd_kv
            hi_p = PPLANE + base + pc
            hi_ok = base + pc < num_pos
            tl.store(hi_p, tl.load(hi_p, mask=hi_ok, other=0.0) + tl.sum(tl.where(wrap, 0.0, rot), axis=0),
                     mask=hi_ok)
            lo_p = base - BLOCK_M + pc
            lo_ok = (lo_p >= 0) & (lo_p < num_pos)
            lo_ptr = PPLANE + num_pos + lo_p
            tl.store(lo_ptr, tl.load(lo_ptr, mask=lo_ok, other=0.0) + tl.sum(tl.where(wrap, rot, 0.0), axis=0),
                     mask=lo_ok)
        if TIME_GRAD:
            nz = ds != 0.0
            b_lo = tl.min(tl.where(nz, tidx, num_tb + 1))
            b_hi = tl.max(tl.where(nz, tidx, -1))
            tb = tl.arange(0, BLOCK_TB)
            for bucket in range(b_lo, b_hi + 1):
                th += tl.where(tb == bucket, tl.sum(tl.where(tidx == bucket, ds, 0.0)), 0.0)
    return dk, dv, cand, scal0, scalc, th


@triton.jit
def _bwd_kv_tile(t, scal0, scalc, th, Q, K, V, DO, DK, DV, pplane, seq_offsets, num_targets, TS, TSQ,
                 pos_w, time_w, tile_seq, tile_blk, h,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh, inv_n, num_pos, num_tb, D_QK, D_V,
                 HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                 POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_TB: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SEMANTIC: tl.constexpr):
    """dK, dV of key tile ``t`` and head ``h``; adds its table-gradient sums to the program's partials."""
    b = tl.load(tile_seq + t)
    if b >= 0:
        start_n = tl.load(tile_blk + t) * BLOCK_N
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
        # history keys are seen by every later query; candidate keys only by themselves. Query blocks that
        # start at or past the end of this key block see all of it when it is all history (no structural mask).
        q_end = tl.where(start_n < hist, L, tl.minimum(L, start_n + BLOCK_N))
        diag_end = tl.minimum(start_n + (BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, q_end)
        all_hist = start_n + BLOCK_N <= hist
        Qh = Q + h * stride_qh
        DOh = DO + h * stride_doh
        dk, dv, cand, scal0, scalc, th = _bwd_kv_sweep(
            dk, dv, cand, scal0, scalc, th, k, v, offs_n, start_n, hist, ts_j, Qh, DOh, TSQ, seq0, start_n,
            diag_end, L, stride_qt, stride_dot, pplane, pos_w, time_w, num_pos, num_tb, inv_n, offs_dk, offs_dv,
            D_QK, D_V, True, HAS_POS, HAS_TIME, HAS_TARGETS, POS_GRAD, TIME_GRAD, UPCAST, PRECISION, TB_DIV,
            BLOCK_M, BLOCK_N, BLOCK_TB, SEMANTIC)
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
            tl.store(DK + h * stride_dkh + tok_n[:, None] * stride_dkt + offs_dk[None, :],
                     dk.to(DK.dtype.element_ty), mask=col_ok[:, None] & (offs_dk[None, :] < D_QK))
        tl.store(DV + h * stride_dvh + tok_n[:, None] * stride_dvt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=col_ok[:, None] & (offs_dv[None, :] < D_V))
        if POS_GRAD and HAS_TARGETS:
            pc = hist - offs_n  # candidate queries sit at position hist: distance hist - j
            hk = offs_n < hist
            c_ok = hk & (pc < num_pos - 1)
            c_ptr = pplane + 2 * num_pos + pc
            tl.store(c_ptr, tl.load(c_ptr, mask=c_ok, other=0.0) + cand, mask=c_ok)
            scalc += tl.sum(tl.where(hk & (pc >= num_pos - 1), cand, 0.0))
    return scal0, scalc, th


@triton.jit
def _hstu_bwd_kv(Q, K, V, DO, DK, DV, DPOS_PART, DPOS_SCAL, DTIME_PART, seq_offsets, num_targets, TS, TSQ,
                 pos_w, time_w, tile_seq, tile_blk,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 inv_n, num_pos, num_tb, D_QK, D_V, num_heads, num_tiles,
                 HAS_TARGETS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                 POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, TB_DIV: tl.constexpr, BLOCK_TB: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, SEMANTIC: tl.constexpr = True):
    """dK, dV of key tiles ``pid, pid + P, pid + 2P, ...`` (``P`` programs on axis 0) and one head
    (``SEMANTIC`` False: dV of a bias-only channel, no dK); with table gradients, this program's partial sums
    of them.

    Position table: a query tile at distance ``base`` from the key tile holds the distances ``base + r``,
    ``r`` in ``(-BLOCK_N, BLOCK_M)``; its diagonal sums (one rotation and two column sums) are added to
    plane 0 (``r >= 0``) and plane 1 (``r < 0``) of this program's row of ``DPOS_PART`` [P * heads, 3,
    num_pos] (``BLOCK_M >= BLOCK_N`` keeps every position of a plane written by one query tile of a key
    tile only); candidate queries (all at position ``hist``) go to plane 2 per key, and distance 0 of
    candidate keys and distances clamped to the table's end to ``DPOS_SCAL`` [P * heads, 2]. Time table: per
    tile, a loop over the buckets present adds each bucket's sum to a register histogram, written once to
    ``DTIME_PART`` [P * heads, BLOCK_TB]. A program owns its row and visits its tiles in a fixed order, and
    the host sums the rows: no atomics, the same result on every run. ``P`` is bounded by the host (not by
    the number of tiles), so the partials are too.
    """
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    if POS_GRAD:
        tl.static_assert(BLOCK_M >= BLOCK_N, "position-table gradients need BLOCK_M >= BLOCK_N")
    row = pid.to(tl.int64) * num_heads + h
    pplane = DPOS_PART + row * 3 * num_pos
    th = tl.zeros((BLOCK_TB,), dtype=tl.float32)
    scal0 = tl.sum(tl.zeros((1,), dtype=tl.float32), axis=0)
    scalc = tl.sum(tl.zeros((1,), dtype=tl.float32), axis=0)
    for t in range(pid, num_tiles, tl.num_programs(0)):
        # the previous tile's partial-row writes, by any thread of this program, are visible to all of them
        tl.debug_barrier()
        scal0, scalc, th = _bwd_kv_tile(
            t, scal0, scalc, th, Q, K, V, DO, DK, DV, pplane, seq_offsets, num_targets, TS, TSQ, pos_w, time_w,
            tile_seq, tile_blk, h, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
            stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, inv_n, num_pos, num_tb, D_QK, D_V,
            HAS_TARGETS, HAS_POS, HAS_TIME, POS_GRAD, TIME_GRAD, UPCAST, PRECISION, TB_DIV, BLOCK_TB, BLOCK_DQK,
            BLOCK_DV, BLOCK_M, BLOCK_N, SEMANTIC)
    if POS_GRAD:
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


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What every launch of one call shares: the constexpr flags, table sizes and the kernels' table
    arguments (a one-element dummy for each one that is off)."""

    interpreted: bool
    flags: dict
    num_pos: int
    num_tb: int
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # pw, tw, ts, tsq, nt


def _common(inputs: AttentionInputs) -> _Launch:
    q, v = inputs.q, inputs.v
    interpreted = check_device(_hstu_fwd, q, inputs.k, v)
    has_time = inputs.uses_time
    flags = dict(
        HAS_TARGETS=inputs.num_targets is not None,
        HAS_POS=inputs.pos_weight is not None,
        HAS_TIME=has_time,
        UPCAST=interpreted,
        PRECISION=dot_precision(q.dtype),
        TB_DIV=TIME_BUCKET_DIV,
        BLOCK_DQK=block_dim(q.shape[-1]),
        BLOCK_DV=block_dim(v.shape[-1]),
    )
    num_pos = inputs.pos_weight.numel() if inputs.pos_weight is not None else 1
    num_tb = inputs.time_weight.numel() - 1 if has_time else 0
    dummy = q.new_zeros(1)
    ts = inputs.timestamps if has_time else dummy
    tables = (
        inputs.pos_weight if inputs.pos_weight is not None else dummy,
        inputs.time_weight if has_time else dummy,
        ts,
        inputs.query_timestamps if has_time and inputs.query_timestamps is not None else ts,
        inputs.num_targets if inputs.num_targets is not None else dummy,
    )
    return _Launch(interpreted, flags, num_pos, num_tb, tables)


def _features(flags: dict, **extra: bool) -> tuple[str, ...]:
    names = ("HAS_TARGETS", "HAS_POS", "HAS_TIME", *extra)
    return tuple(n for n in names if {**flags, **extra}.get(n))


# Programs per launch (over all heads) of the dK/dV kernel when it reduces bias-table gradients: each owns one
# row of partial sums and loops over its share of the key tiles, so the partials are bounded by this rather
# than by tiles x heads (enough programs to fill a large GPU several times over).
PARTIAL_PROGRAMS = 1024


def partial_programs(num_tiles: int, num_heads: int, table_grads: bool) -> int:
    """Programs per head of the dK/dV kernel: one per key tile, or at most ``PARTIAL_PROGRAMS`` over all heads
    when the program rows hold bias-table partials."""
    if not table_grads:
        return max(1, num_tiles)
    return max(1, min(num_tiles, PARTIAL_PROGRAMS // max(1, num_heads)))


def partial_bytes(num_programs: int, num_heads: int, num_pos: int, num_tb: int, pos_grad: bool,
                  time_grad: bool) -> int:
    """Bytes of the dK/dV kernel's fp32 bias-table partials for ``num_programs`` programs per head."""
    row = (3 * num_pos + 2 if pos_grad else 0) + (triton.next_power_of_2(num_tb + 1) if time_grad else 0)
    return 4 * num_programs * num_heads * row


def _backward_kv(inputs: AttentionInputs, dout: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, run: _Launch, *,
                 inv_n: float, pos_grad: bool, time_grad: bool, key: TuneKey,
                 semantic: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launches the dK/dV kernel (``k is q``, ``dk is dv`` for a bias-only channel) and returns the fp32
    position- and time-table gradients (None where not wanted), reduced from the programs' partial rows."""
    q, k, v, offsets = inputs.q, inputs.k, inputs.v, inputs.offsets
    pw, tw, ts, tsq, nt = run.tables
    num_pos, num_tb = run.num_pos, run.num_tb
    n_tok, num_heads, _ = q.shape
    block_tb = triton.next_power_of_2(num_tb + 1)
    f32 = dict(dtype=torch.float32, device=q.device)
    parts: dict[str, torch.Tensor] = {}
    if n_tok and num_heads:
        dummy32 = torch.zeros(1, **f32)

        def launch(cfg: TileConfig) -> None:
            if pos_grad and cfg.block_m < cfg.block_n:  # the diagonal sums need BLOCK_M >= BLOCK_N
                cfg = dataclasses.replace(cfg, block_m=cfg.block_n)
            seq_n, blk_n = jagged_tiles(offsets, n_tok, cfg.block_n)
            programs = partial_programs(seq_n.numel(), num_heads, pos_grad or time_grad)
            rows = programs * num_heads
            parts.update(
                pos=torch.zeros((rows, 3, num_pos), **f32) if pos_grad else dummy32,
                pos_scal=torch.zeros((rows, 2), **f32) if pos_grad else dummy32,
                time=torch.zeros((rows, block_tb), **f32) if time_grad else dummy32)
            _hstu_bwd_kv[(programs, num_heads)](
                q, k, v, dout, dk, dv, parts["pos"], parts["pos_scal"], parts["time"],
                offsets, nt, ts, tsq, pw, tw, seq_n, blk_n,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                inv_n, num_pos, num_tb, q.shape[-1], v.shape[-1], num_heads, seq_n.numel(),
                POS_GRAD=pos_grad, TIME_GRAD=time_grad, BLOCK_TB=block_tb,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, SEMANTIC=semantic, **run.flags,
            )

        run_tuned(key, run.interpreted, launch)
    dpos_w = dtime_w = None
    if pos_grad:
        dpos_w = torch.zeros(num_pos, **f32)
        if parts:
            dpos_w += parts["pos"].sum(dim=(0, 1))
            dpos_w[0] += parts["pos_scal"][:, 0].sum()
            dpos_w[num_pos - 1] += parts["pos_scal"][:, 1].sum()
        dpos_w = dpos_w.to(inputs.pos_weight.dtype)
    if time_grad:
        dtime_w = parts["time"].sum(0)[:num_tb + 1] if parts else torch.zeros(num_tb + 1, **f32)
        dtime_w = dtime_w.to(inputs.time_weight.dtype)
    return dpos_w, dtime_w


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """A cached prefix for the serving forward: sequence b's K/V are rows ``starts[b] .. starts[b] +
    lengths[b] - 1`` of ``k``/``v`` [T, H, d] (``timestamps`` [T] with the time bias)."""

    k: torch.Tensor
    v: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    timestamps: torch.Tensor | None


def _forward(inputs: AttentionInputs, prefix: _Prefix | None = None, semantic: bool = True) -> torch.Tensor:
    run = _common(inputs)
    q, k, v, offsets = inputs.q, inputs.k, inputs.v, inputs.offsets
    pw, tw, ts, tsq, nt = run.tables
    n_tok, num_heads, _ = q.shape
    out = torch.empty((n_tok, num_heads, v.shape[-1]), dtype=v.dtype, device=v.device)
    if n_tok == 0 or num_heads == 0:
        return out
    has_prefix = prefix is not None
    kp = prefix.k if has_prefix else k
    vp = prefix.v if has_prefix else v
    tsp = prefix.timestamps if has_prefix and run.flags["HAS_TIME"] else ts

    def launch(cfg: TileConfig) -> None:
        tile_seq, tile_blk = jagged_tiles(offsets, n_tok, cfg.block_m)
        _hstu_fwd[(tile_seq.numel(), num_heads)](
            q, k, v, kp, vp, out, offsets, prefix.starts if has_prefix else offsets,
            prefix.lengths if has_prefix else offsets, nt, ts, tsq, tsp, pw, tw,
            tile_seq, tile_blk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kp.stride(0), kp.stride(1), vp.stride(0), vp.stride(1), out.stride(0), out.stride(1),
            1.0 / inputs.max_seq_len, run.num_pos, run.num_tb, q.shape[-1], v.shape[-1],
            HAS_PREFIX=has_prefix, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, SEMANTIC=semantic, **run.flags,
        )

    key = TuneKey("fwd", str(q.dtype), run.flags["BLOCK_DQK"], run.flags["BLOCK_DV"], num_heads,
                  _features(run.flags, HAS_PREFIX=has_prefix, CHANNEL=not semantic),
                  max_len_bucket(inputs.max_seq_len))
    run_tuned(key, run.interpreted, launch)
    return out


def _contiguous(inputs: AttentionInputs, q, k, v, pos_w, time_w) -> AttentionInputs:
    """``inputs`` with the autograd inputs (the tensors ``apply`` received) last-dim contiguous."""
    return inputs.replace(q=_last_dim_contiguous(q), k=_last_dim_contiguous(k), v=_last_dim_contiguous(v),
                          pos_weight=pos_w, time_weight=time_w)


class _HstuAttention(torch.autograd.Function):
    """Differentiable in the tensors ``apply`` gets; the rest of the inputs ride along in ``inputs``."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, q, k, v, pos_w, time_w, inputs: AttentionInputs):
        inputs = _contiguous(inputs, q, k, v, pos_w, time_w)
        out = _forward(inputs)
        ctx.save_for_backward(inputs.q, inputs.k, inputs.v)
        # q, k, v only as saved tensors (saved-tensor hooks see them); they go back in in backward
        ctx.inputs = inputs.replace(q=None, k=None, v=None)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        inputs = ctx.inputs.replace(q=q, k=k, v=v)
        dout = _last_dim_contiguous(dout).to(v.dtype)
        run = _common(inputs)
        pos_grad = inputs.pos_weight is not None and ctx.needs_input_grad[3]
        time_grad = run.flags["HAS_TIME"] and ctx.needs_input_grad[4]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        n_tok, num_heads, _ = q.shape
        inv_n = 1.0 / inputs.max_seq_len
        common = (str(q.dtype), run.flags["BLOCK_DQK"], run.flags["BLOCK_DV"], num_heads)
        bucket = max_len_bucket(inputs.max_seq_len)
        dpos_w, dtime_w = _backward_kv(  # launches nothing without tokens or heads (zero table gradients)
            inputs, dout, dk, dv, run, inv_n=inv_n, pos_grad=pos_grad, time_grad=time_grad, semantic=True,
            key=TuneKey("bwd_kv", *common, _features(run.flags, POS_GRAD=pos_grad, TIME_GRAD=time_grad), bucket))
        if not (n_tok and num_heads):
            return dq.zero_(), dk.zero_(), dv.zero_(), dpos_w, dtime_w, None
        pw, tw, ts, tsq, nt = run.tables

        def launch_q(cfg: TileConfig) -> None:
            seq_m, blk_m = jagged_tiles(inputs.offsets, n_tok, cfg.block_m)
            _hstu_bwd_q[(seq_m.numel(), num_heads)](
                q, k, v, dout, dq, inputs.offsets, nt, ts, tsq, pw, tw, seq_m, blk_m,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                inv_n, run.num_pos, run.num_tb, q.shape[-1], v.shape[-1],
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **run.flags,
            )

        run_tuned(TuneKey("bwd_q", *common, _features(run.flags), bucket), run.interpreted, launch_q)
        return dq, dk, dv, dpos_w, dtime_w, None


def _autocast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under CUDA autocast, the tensors in the autocast dtype (bf16 operands, fp32 accumulation)."""
    if torch.is_autocast_enabled("cuda") and tensors[0].is_cuda:
        dtype = torch.get_autocast_dtype("cuda")
        return tuple(t.to(dtype) for t in tensors)
    return tensors


def hstu_attention_triton(inputs: AttentionInputs) -> torch.Tensor:
    """Fused jagged HSTU attention; differentiable in q, k, v, pos_weight and time_weight.

    ``query_timestamps``: the time bias buckets ``query_timestamps[i] - timestamps[j]`` (None: each token's
    own timestamp). Under CUDA autocast q, k and v run in the autocast dtype (bf16 operands, fp32
    accumulation) and the output has that dtype.
    """
    q, k, v = _autocast(inputs.q, inputs.k, inputs.v)
    return _HstuAttention.apply(q, k, v, inputs.pos_weight, inputs.time_weight, inputs)


def hstu_attention_with_prefix_triton(
    inputs: AttentionInputs,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_offsets: torch.Tensor | None = None,
    *,
    prefix_starts: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
    prefix_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward only (serving): new tokens attend to their sequence's cached prefix K/V and to themselves.

    Sequence b's prefix is tokens ``prefix_starts[b] .. prefix_starts[b] + prefix_lengths[b] - 1`` of
    ``k_prefix``/``v_prefix`` [T, H, d] (and ``prefix_timestamps`` [T]): ranges may be in any order, with gaps
    (a KV arena holding many users' prefixes, read in place). ``prefix_offsets`` [B + 1] is the jagged
    special case (prefixes concatenated in batch order) and is used when the two are not given.
    ``query_timestamps`` [sum_S]: the new tokens' query times (see :func:`hstu_attention_triton`).
    """
    if inputs.uses_time and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    if prefix_starts is None or prefix_lengths is None:
        if prefix_offsets is None:
            raise ValueError("give prefix_offsets, or prefix_starts and prefix_lengths")
        prefix_starts, prefix_lengths = prefix_offsets[:-1], prefix_offsets[1:] - prefix_offsets[:-1]
    with torch.no_grad():
        inputs = inputs.replace(q=_last_dim_contiguous(inputs.q), k=_last_dim_contiguous(inputs.k),
                                v=_last_dim_contiguous(inputs.v))
        k_prefix, v_prefix = _last_dim_contiguous(k_prefix), _last_dim_contiguous(v_prefix)
        return _forward(inputs, _Prefix(k_prefix, v_prefix, prefix_starts, prefix_lengths, prefix_timestamps))


class _BiasChannel(torch.autograd.Function):
    """FuXi-α's bias-only channel: the attention kernels with ``SEMANTIC=False`` (no q·k, SiLU or 1/N)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, v, pos_w, time_w, inputs: AttentionInputs):
        inputs = _contiguous(inputs, v, v, v, pos_w, time_w)
        out = _forward(inputs, semantic=False)
        ctx.save_for_backward(inputs.v)
        ctx.inputs = inputs.replace(q=None, k=None, v=None)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        (v,) = ctx.saved_tensors
        inputs = ctx.inputs.replace(q=v, k=v, v=v)
        dout = _last_dim_contiguous(dout).to(v.dtype)
        run = _common(inputs)
        pos_grad = inputs.pos_weight is not None and ctx.needs_input_grad[1]
        time_grad = run.flags["HAS_TIME"] and ctx.needs_input_grad[2]
        dv = torch.zeros_like(v)
        key = TuneKey("bwd_kv", str(v.dtype), run.flags["BLOCK_DQK"], run.flags["BLOCK_DV"], v.shape[1],
                      _features(run.flags, POS_GRAD=pos_grad, TIME_GRAD=time_grad, CHANNEL=True),
                      max_len_bucket(inputs.max_seq_len))
        dpos_w, dtime_w = _backward_kv(inputs, dout, dv, dv, run, inv_n=1.0, pos_grad=pos_grad,
                                       time_grad=time_grad, semantic=False, key=key)
        return dv, dpos_w, dtime_w, None


def bias_channel_triton(inputs: AttentionInputs) -> torch.Tensor:
    """FuXi-α's bias-only channel (:mod:`grstack.kernels.fuxi`), fused; differentiable in v and the tables
    (``inputs``: :meth:`AttentionInputs.channel`; ``query_timestamps`` as :func:`hstu_attention_triton`'s)."""
    (v,) = _autocast(inputs.v)
    return _BiasChannel.apply(v, inputs.pos_weight, inputs.time_weight, inputs)


def bias_channel_with_prefix_triton(inputs: AttentionInputs, v_prefix: torch.Tensor, prefix_offsets: torch.Tensor,
                                    prefix_timestamps: torch.Tensor | None = None) -> torch.Tensor:
    """Serving: the bias-only channel for new tokens after cached prefixes (``v_prefix`` [T, H, dv] jagged by
    ``prefix_offsets``), forward only (``inputs``: :meth:`AttentionInputs.channel`)."""
    with torch.no_grad():
        v, v_prefix = _last_dim_contiguous(inputs.v), _last_dim_contiguous(v_prefix)
        inputs = inputs.replace(q=v, k=v, v=v)
        prefix = _Prefix(v_prefix, v_prefix, prefix_offsets[:-1], prefix_offsets[1:] - prefix_offsets[:-1],
                         prefix_timestamps)
        return _forward(inputs, prefix, semantic=False)

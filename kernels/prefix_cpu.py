"""Cached-prefix HSTU attention for CPU serving (the ``reference`` backend of
:func:`grstack.kernels.hstu_attention_with_prefix`): the math of
:func:`grstack.kernels.reference.hstu_attention_with_prefix_reference`, arranged for the ranker's hot path.

- Bias indices (position distances, log time buckets) and masks depend only on the batch, not on the
  layer, so they are computed once per :class:`PrefixPlan` (one per forward) and every layer only gathers its
  weights; against the prefix they are computed once per distinct query (position, query time) — all
  candidates share one — and expanded by row.
- Each sequence's cached prefix is one [H, P, d] tensor per layer (head-major:
  :data:`grstack.kernels.plan.HEAD_MAJOR`; contiguous, or a view of a serving KV arena [H, T, d] whose rows
  are contiguous), so ``q @ k^T`` is a plain batched matmul with no copy, and
  prefix and new tokens are two blocks instead of a concatenation.
- Every new row may see every prefix token (prefix tokens precede all new tokens and are all history, given
  ``num_targets[b] <= S_b``), so the prefix block needs no mask: its ``allowed / N`` is the constant ``1 / N``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grstack.kernels.bias import time_buckets
from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.plan import PrefixPlan, cached, make_prefix_plan, tensor_key


@dataclass(frozen=True)
class _Seq:
    b: int  # sequence index in the batch
    n0: int  # rows [n0, n1) of the new tokens
    n1: int
    rows: torch.Tensor  # [n] row of each new token in the distinct-row tables below
    pos_pre: torch.Tensor | None  # [u, P] index into pos_w, one row per distinct (position, time) query
    pos_new: torch.Tensor | None  # [n, n]
    tb_pre: torch.Tensor | None  # [u, P] index into time_w
    tb_new: torch.Tensor | None  # [n, n]
    scale_new: torch.Tensor  # [n, n] allowed / N among the new tokens


def _tables(plan: PrefixPlan, device: torch.device, dtype: torch.dtype, max_seq_len: int, num_pos: int | None,
            num_tb: int | None, timestamps: torch.Tensor | None, prefix_timestamps: Sequence[torch.Tensor] | None,
            num_targets: torch.Tensor | None, query_timestamps: torch.Tensor | None) -> tuple[_Seq, ...]:
    """Per non-empty sequence: masks and bias-table indices (depend on the batch, not on the layer).
    ``query_timestamps``: the new tokens' query times in the time bucket (None: their own timestamps)."""

    def build() -> tuple[_Seq, ...]:
        nts = num_targets.tolist() if num_targets is not None else [0] * plan.batch_size
        seqs = []
        for b in range(plan.batch_size):
            n0, n1, p = plan.offsets[b], plan.offsets[b + 1], plan.prefix_lengths[b]
            n = n1 - n0
            if n == 0:
                continue
            hist = p + n - int(nts[b])
            gi = p + torch.arange(n, device=device)
            pos_i = gi.clamp(max=hist)
            li = torch.arange(n, device=device)
            allowed = (li[None, :] <= li[:, None]) & ((gi[None, :] < hist) | (li[None, :] == li[:, None]))
            ts_i = timestamps[n0:n1] if num_tb is not None else torch.zeros_like(pos_i)
            qt_i = query_timestamps[n0:n1] if num_tb is not None and query_timestamps is not None else ts_i
            # All candidates share one position and one query time, so their bias rows against the prefix are
            # equal: compute the [rows, P] tables once per distinct (position, query time).
            uniq, rows = torch.unique(torch.stack([pos_i, qt_i.to(pos_i.dtype)], 1), dim=0, return_inverse=True)
            pos_pre = pos_new = tb_pre = tb_new = None
            if num_pos is not None:
                pos_pre = (uniq[:, 0:1] - torch.arange(p, device=device)[None, :]).clamp(0, num_pos - 1)
                pos_new = (pos_i[:, None] - pos_i[None, :]).clamp(0, num_pos - 1)
            if num_tb is not None:
                tb_pre = time_buckets(uniq[:, 1:2] - prefix_timestamps[b][None, :], num_tb)
                tb_new = time_buckets(qt_i[:, None] - ts_i[None, :], num_tb)
            seqs.append(_Seq(b, n0, n1, rows, pos_pre, pos_new, tb_pre, tb_new, allowed.to(dtype) / max_seq_len))
        return tuple(seqs)

    ts = timestamps if num_tb is not None else None
    qts = query_timestamps if num_tb is not None else None
    pts = list(prefix_timestamps) if num_tb is not None else []
    key = ("prefix_cpu", device, dtype, max_seq_len, num_pos, num_tb, tensor_key(ts),
           tuple(tensor_key(t) for t in pts), tensor_key(num_targets), tensor_key(qts))
    keep = [t for t in (ts, num_targets, qts) if t is not None] + pts
    return cached(plan, key, build, keep_alive=keep)


def _bias(pos_w: torch.Tensor | None, time_w: torch.Tensor | None, pos: torch.Tensor | None,
          tb: torch.Tensor | None) -> torch.Tensor | None:
    bias = pos_w[pos] if pos_w is not None and pos is not None else None
    if time_w is not None and tb is not None:
        bias = time_w[tb] if bias is None else bias + time_w[tb]
    return bias


def hstu_attention_with_prefix_cpu(
    inputs: AttentionInputs,
    k_prefix: Sequence[torch.Tensor],
    v_prefix: Sequence[torch.Tensor],
    *,
    prefix_timestamps: Sequence[torch.Tensor] | None = None,
    plan: PrefixPlan | None = None,
) -> torch.Tensor:
    """q, k: [sum_S, H, dqk]; v: [sum_S, H, dv]; per sequence ``k_prefix[b]`` [H, P_b, dqk] and
    ``v_prefix[b]`` [H, P_b, dv] (head-major). Returns [sum_S, H, dv]: the new tokens' rows of the
    full-sequence attention. ``query_timestamps`` [sum_S]: the new tokens' query times in the time bias
    (None: their own timestamps)."""
    q, k, v, offsets, timestamps = inputs.q, inputs.k, inputs.v, inputs.offsets, inputs.timestamps
    pos_weight, time_weight, num_targets = inputs.pos_weight, inputs.time_weight, inputs.num_targets
    max_seq_len, query_timestamps = inputs.max_seq_len, inputs.query_timestamps
    if plan is None:
        plan = make_prefix_plan(offsets, [kp.shape[1] for kp in k_prefix])
    has_time = time_weight is not None and timestamps is not None
    if has_time and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    seqs = _tables(plan, q.device, q.dtype, max_seq_len,
                   pos_weight.numel() if pos_weight is not None else None,
                   time_weight.numel() - 1 if has_time else None, timestamps, prefix_timestamps, num_targets,
                   query_timestamps)
    # bias tables in the compute dtype once per call, not per sequence
    if pos_weight is not None and pos_weight.dtype != q.dtype:
        pos_weight = pos_weight.to(q.dtype)
    time_weight = time_weight if has_time else None
    if time_weight is not None and time_weight.dtype != q.dtype:
        time_weight = time_weight.to(q.dtype)
    out = v.new_empty(v.shape)  # every row belongs to one non-empty sequence
    inv_n = 1.0 / max_seq_len
    for s in seqs:
        kp, vp = k_prefix[s.b], v_prefix[s.b]
        qb = q[s.n0:s.n1].transpose(0, 1)  # [H, n, d]
        kb = k[s.n0:s.n1].transpose(0, 1)
        vb = v[s.n0:s.n1].transpose(0, 1)
        b_new = _bias(pos_weight, time_weight, s.pos_new, s.tb_new)
        s_new = torch.matmul(qb, kb.transpose(1, 2))
        if b_new is not None:
            s_new = s_new + b_new
        o = torch.matmul(F.silu(s_new) * s.scale_new, vb)
        if kp.shape[1]:
            b_pre = _bias(pos_weight, time_weight, s.pos_pre, s.tb_pre)
            s_pre = torch.matmul(qb, kp.transpose(1, 2))
            if b_pre is not None:
                s_pre = s_pre + b_pre.index_select(0, s.rows)
            o = o + torch.matmul(F.silu(s_pre), vp) * inv_n
        out[s.n0:s.n1] = o.transpose(0, 1)
    return out

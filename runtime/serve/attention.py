"""Cached-prefix HSTU attention for CPU serving: the same math as
:func:`grstack.kernels.reference.hstu_attention_with_prefix_reference`, arranged for the ranker's hot path.

- Bias indices (position distances, log time buckets) and masks depend only on the request, not on the
  layer, so they are computed once per forward (:func:`make_plan`) and every layer only gathers its weights;
  against the prefix they are computed once per distinct query (position, timestamp) — all candidates
  share one — and expanded by row.
- The cached prefix is stored per layer as [H, P, d] (head-major, contiguous), so ``q @ k^T`` is a plain
  batched matmul with no copy, and prefix and new tokens are two blocks instead of a concatenation.
- Every new row may see every prefix token (prefix tokens precede all new tokens and are all history), so
  the prefix block needs no mask: its ``allowed / N`` is the constant ``1 / N``.

On accelerators the ranker uses the kernels' dispatcher instead (fused Triton kernel, [P, H, d] layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grstack.kernels.reference import time_buckets


@dataclass(frozen=True)
class _Seq:
    n0: int  # rows [n0, n1) of the new tokens
    n1: int
    rows: torch.Tensor  # [n] row of each new token in the distinct-row tables below
    pos_pre: torch.Tensor | None  # [u, P] index into pos_w, one row per distinct (position, time) query
    pos_new: torch.Tensor | None  # [n, n]
    tb_pre: torch.Tensor | None  # [u, P] index into time_w
    tb_new: torch.Tensor | None  # [n, n]
    scale_new: torch.Tensor  # [n, n] allowed / N among the new tokens


@dataclass(frozen=True)
class PrefixPlan:
    seqs: tuple[_Seq, ...]
    inv_n: float


def make_plan(offsets: list[int], prefix_lens: list[int], num_targets: list[int], timestamps: torch.Tensor | None,
              prefix_timestamps: list[torch.Tensor] | None, *, max_seq_len: int, num_pos: int | None,
              num_time_buckets: int | None) -> PrefixPlan:
    """Sequence b's new tokens are rows ``offsets[b]:offsets[b+1]``, at positions ``P_b..`` after a cached
    prefix of ``prefix_lens[b]`` tokens; its last ``num_targets[b]`` new tokens are candidates."""
    seqs = []
    device = timestamps.device if timestamps is not None else torch.device("cpu")
    for b in range(len(offsets) - 1):
        n0, n1, p = offsets[b], offsets[b + 1], prefix_lens[b]
        n = n1 - n0
        hist = p + n - num_targets[b]
        gi = p + torch.arange(n, device=device)
        pos_i = gi.clamp(max=hist)
        li = torch.arange(n, device=device)
        allowed = (li[None, :] <= li[:, None]) & ((gi[None, :] < hist) | (li[None, :] == li[:, None]))
        use_time = num_time_buckets is not None and timestamps is not None and prefix_timestamps is not None
        ts_i = timestamps[n0:n1] if use_time else torch.zeros_like(pos_i)
        # All candidates share one position and one timestamp, so their bias rows against the prefix are
        # equal: compute the [rows, P] tables once per distinct (position, timestamp).
        uniq, rows = torch.unique(torch.stack([pos_i, ts_i], 1), dim=0, return_inverse=True)
        pos_pre = pos_new = tb_pre = tb_new = None
        if num_pos is not None:
            pos_pre = (uniq[:, 0:1] - torch.arange(p, device=device)[None, :]).clamp(0, num_pos - 1)
            pos_new = (pos_i[:, None] - pos_i[None, :]).clamp(0, num_pos - 1)
        if use_time:
            tb_pre = time_buckets(uniq[:, 1:2] - prefix_timestamps[b][None, :], num_time_buckets)
            tb_new = time_buckets(ts_i[:, None] - ts_i[None, :], num_time_buckets)
        seqs.append(_Seq(n0, n1, rows, pos_pre, pos_new, tb_pre, tb_new, allowed.float() / max_seq_len))
    return PrefixPlan(tuple(seqs), 1.0 / max_seq_len)


def _bias(pos_w: torch.Tensor | None, time_w: torch.Tensor | None, pos: torch.Tensor | None,
          tb: torch.Tensor | None) -> torch.Tensor | None:
    bias = pos_w[pos] if pos_w is not None and pos is not None else None
    if time_w is not None and tb is not None:
        bias = time_w[tb] if bias is None else bias + time_w[tb]
    return bias


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: list[torch.Tensor],
                     v_prefix: list[torch.Tensor], plan: PrefixPlan, pos_weight: torch.Tensor | None,
                     time_weight: torch.Tensor | None) -> torch.Tensor:
    """q, k: [sum_n, H, dqk]; v: [sum_n, H, dv]; per sequence k_prefix [H, P, dqk], v_prefix [H, P, dv].
    Returns [sum_n, H, dv]: the new tokens' rows of the full-sequence attention."""
    out = v.new_empty(v.shape)
    for s, kp, vp in zip(plan.seqs, k_prefix, v_prefix, strict=True):
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
            o = o + torch.matmul(F.silu(s_pre), vp) * plan.inv_n
        out[s.n0:s.n1] = o.transpose(0, 1)
    return out

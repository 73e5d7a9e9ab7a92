"""Torch reference of jagged HSTU attention: the oracle for every fused kernel, and the CPU path.

Math (docs/architecture.md §3), per sequence of length L with ``M`` candidate tokens at the end (``M = 0``
for plain causal training) and history length ``Hn = L - M``::

    pos_i   = min(i, Hn)                                  # candidates all sit at the next position
    allowed = (j <= i) and (j < Hn or j == i)              # causal; candidates see history and themselves
    bias    = pos_w[clamp(pos_i - pos_j, 0, N - 1)] + time_w[bucket(qts_i - ts_j)]
    A       = SiLU(q_i . k_j + bias) * allowed / N          # N = max_seq_len, a constant
    out_i   = sum_j A_ij v_j

``N`` is a constant, so a prefix's keys and values never depend on what is appended after it — the
property relay inference relies on. ``bucket`` is :func:`grstack.kernels.bias.time_buckets`. ``qts_i`` is
token i's query time: ``query_timestamps[i]`` when given (e.g. the time of the event after token i, Meta's
convention), else its own timestamp ``ts_i``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from grstack.kernels.bias import time_buckets
from grstack.kernels.grouped import grouped_hstu_attention
from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.jagged import jagged_to_padded, padded_to_jagged
from grstack.kernels.plan import (
    JaggedPlan,
    PrefixPlan,
    gather_groups,
    make_plan,
    make_prefix_plan,
    scatter_groups,
)


def _dense_block(
    q: torch.Tensor,  # [G, L, H, dqk]
    k: torch.Tensor,
    v: torch.Tensor,  # [G, L, H, dv]
    lengths: torch.Tensor,  # [G]
    ts: torch.Tensor | None,  # [G, L]
    qts: torch.Tensor | None,  # [G, L] query times (None: ts)
    num_targets: torch.Tensor | None,  # [G]
    pos_w: torch.Tensor | None,
    time_w: torch.Tensor | None,
    max_seq_len: int,
) -> torch.Tensor:
    L = q.shape[1]
    device = q.device
    ar = torch.arange(L, device=device)
    if num_targets is not None:
        hist = (lengths - num_targets).clamp(min=0)  # [G]
        pos = torch.minimum(ar[None, :], hist[:, None])  # [G, L]
        j_hist = ar[None, None, :] < hist[:, None, None]  # [G, 1, L]
        diag = ar[None, :, None] == ar[None, None, :]
        allowed = (ar[None, :, None] >= ar[None, None, :]) & (j_hist | diag)  # [G, L, L]
        dist = pos[:, :, None] - pos[:, None, :]
    else:
        allowed = (ar[:, None] >= ar[None, :])[None]  # [1, L, L]
        dist = (ar[:, None] - ar[None, :])[None]
    scores = torch.matmul(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1))  # [G, H, L, L]
    bias = None
    if pos_w is not None:
        bias = pos_w[dist.clamp(0, pos_w.numel() - 1)]
    if time_w is not None and ts is not None:
        qts = ts if qts is None else qts
        tb = time_w[time_buckets(qts[:, :, None] - ts[:, None, :], time_w.numel() - 1)]
        bias = tb if bias is None else bias + tb
    if bias is not None:
        scores = scores + bias.unsqueeze(1).to(scores.dtype)
    attn = F.silu(scores) * (allowed.unsqueeze(1).to(scores.dtype) / max_seq_len)
    out = torch.matmul(attn, v.permute(0, 2, 1, 3))  # [G, H, L, dv]
    return out.permute(0, 2, 1, 3)


def hstu_attention_reference(inputs: AttentionInputs, plan: JaggedPlan | None = None) -> torch.Tensor:
    """Jagged [sum_L, H, d] in, [sum_L, H, dv] out; computed per length group, never padded to L_max.

    The work is done by :mod:`grstack.kernels.grouped` (batch constants cached on ``plan``, causal chunks,
    hand-written backward); :func:`hstu_attention_padded` is the plain-autograd formulation it is tested
    against.
    """
    plan = plan if plan is not None else make_plan(inputs.offsets)
    if not plan.groups:
        q, v = inputs.q, inputs.v
        return v.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    return grouped_hstu_attention(inputs, plan)


def hstu_attention_padded(inputs: AttentionInputs) -> torch.Tensor:
    """The dense padded implementation of the same math ([B, L_max, L_max] bias): baseline and oracle."""
    q, k, v, offsets, timestamps = inputs.q, inputs.k, inputs.v, inputs.offsets, inputs.timestamps
    query_timestamps = inputs.query_timestamps
    lengths = offsets[1:] - offsets[:-1]
    if q.shape[0] == 0:
        return v.new_zeros(v.shape)
    qp, kp, vp = (jagged_to_padded(t, offsets) for t in (q, k, v))
    tp = jagged_to_padded(timestamps, offsets) if timestamps is not None else None
    qtp = jagged_to_padded(query_timestamps, offsets) if query_timestamps is not None else None
    out = _dense_block(qp, kp, vp, lengths, tp, qtp, inputs.num_targets, inputs.pos_weight, inputs.time_weight,
                       inputs.max_seq_len)
    return padded_to_jagged(out, offsets)


def hstu_attention_with_prefix_reference(
    inputs: AttentionInputs,
    k_prefix: Sequence[torch.Tensor],
    v_prefix: Sequence[torch.Tensor],
    *,
    prefix_timestamps: Sequence[torch.Tensor] | None = None,
    plan: PrefixPlan | None = None,
) -> torch.Tensor:
    """The plain formulation of the cached-prefix op (the oracle of its fast paths).

    Per sequence b, the new tokens (``offsets``, S_b of them) are positions ``P_b..P_b+S_b-1`` of a sequence
    whose first ``P_b`` tokens' K/V are ``k_prefix[b]``, ``v_prefix[b]`` ([P_b, H, d], token-major).
    ``num_targets`` counts the candidates among the new tokens; ``query_timestamps`` [sum_S] are the new tokens'
    query times (None: their own timestamps; the prefix's tokens are keys only). Returns [sum_S, H, dv], equal to the
    full-sequence attention's rows for the new tokens. Computed directly on the [S_b, P_b + S_b] rectangle of
    each sequence (prefix and new K/V concatenated, one mask).
    """
    q, k, v, offsets, timestamps = inputs.q, inputs.k, inputs.v, inputs.offsets, inputs.timestamps
    pos_weight, time_weight, num_targets = inputs.pos_weight, inputs.time_weight, inputs.num_targets
    max_seq_len, query_timestamps = inputs.max_seq_len, inputs.query_timestamps
    plan = plan if plan is not None else make_prefix_plan(offsets, [kp.shape[0] for kp in k_prefix])
    offs = plan.offsets
    out = v.new_zeros(v.shape)
    has_time = time_weight is not None and timestamps is not None
    if has_time and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    for b in range(len(offs) - 1):
        s0, s1 = offs[b], offs[b + 1]
        if s1 == s0:
            continue
        n_pre, n_new = plan.prefix_lengths[b], s1 - s0
        total = n_pre + n_new
        hist = total - int(num_targets[b]) if num_targets is not None else total
        hist = max(hist, 0)
        gi = torch.arange(n_pre, total, device=q.device)
        gj = torch.arange(total, device=q.device)
        allowed = (gj[None, :] <= gi[:, None]) & ((gj[None, :] < hist) | (gj[None, :] == gi[:, None]))
        kb = torch.cat([k_prefix[b], k[s0:s1]]).transpose(0, 1)  # [H, P+S, d]
        vb = torch.cat([v_prefix[b], v[s0:s1]]).transpose(0, 1)
        scores = torch.matmul(q[s0:s1].transpose(0, 1), kb.transpose(1, 2))  # [H, S, P+S]
        bias = None
        if pos_weight is not None:
            dist = torch.clamp_max(gi, hist)[:, None] - torch.clamp_max(gj, hist)[None, :]
            bias = pos_weight[dist.clamp(0, pos_weight.numel() - 1)]
        if has_time:
            ts = torch.cat([prefix_timestamps[b], timestamps[s0:s1]])
            qts = timestamps[s0:s1] if query_timestamps is None else query_timestamps[s0:s1]
            tb = time_weight[time_buckets(qts[:, None] - ts[None, :], time_weight.numel() - 1)]
            bias = tb if bias is None else bias + tb
        if bias is not None:
            scores = scores + bias.unsqueeze(0).to(scores.dtype)
        attn = F.silu(scores) * (allowed.unsqueeze(0).to(scores.dtype) / max_seq_len)
        out[s0:s1] = torch.matmul(attn, vb).transpose(0, 1)
    return out


def causal_softmax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                                       *, plan: JaggedPlan | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Jagged causal softmax attention (SASRec's), q, k, v: [sum_L, H, d] -> [sum_L, H, d].

    Runs per length group of the plan (no [B, L_max] padding): padded keys sit after every real query, so
    the causal mask alone keeps them out.
    """
    plan = plan if plan is not None else make_plan(offsets)
    if not plan.groups:
        return v.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
    outs = []
    for qb, kb, vb in zip(gather_groups(q, plan), gather_groups(k, plan), gather_groups(v, plan), strict=True):
        o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                           is_causal=True, dropout_p=dropout_p)
        outs.append(o.transpose(1, 2))
    return scatter_groups(outs, plan)


def layer_norm_mul_reference(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor | None,
                             bias: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """HSTU's ``LN(A V) ⊙ U`` over the last dimension, jagged [sum_L, D]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps) * u


def embedding_gather_reference(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``table`` for flat jagged ``ids`` [sum_L] -> [sum_L, D]."""
    return F.embedding(ids, table)

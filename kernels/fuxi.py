"""FuXi-α's positional and temporal attention channels (the bias-only channels of its multi-channel attention).

In FuXi-α (Ye et al. 2025; USTC-StarTeam/FuXi-alpha ``modeling/sequential/fuxi.py``) these two channels have
no queries or keys: a token's attention weights come from the relative position or the time gap alone, are
masked causally and applied to the values (shared with the semantic channel) as they are — no SiLU, no
``1/N``. Per sequence of length L with ``M`` candidates at the end (history ``Hn = L - M``), as
:mod:`grstack.kernels.reference` defines positions and the mask::

    pos_i   = min(i, Hn)
    allowed = (j <= i) and (j < Hn or j == i)
    A_ij    = (pos_w[clamp(pos_i - pos_j, 0, N - 1)] + time_w[bucket(qts_i - ts_j)]) * allowed
    out_i   = sum_j A_ij v_j                                   # the same A for every head

``qts`` is ``ts`` unless ``query_timestamps`` are given (FuXi-α's code: the next event's time; training and
evaluation only, as for HSTU: docs/time-bias.md). Pass only ``pos_weight`` for the positional channel, only
``time_weight`` (with ``timestamps``) for the temporal one. ``A`` depends on positions and timestamps only, so
a cached prefix's values (the semantic channel's, already in the relay cache) are all the with-prefix variant
needs.

:func:`grstack.kernels.hstu_attention` cannot compute this function (its weights are ``SiLU(q·k + bias)/N``,
a non-linear function of the bias); its Triton kernels can, with ``SEMANTIC=False`` (no q·k, SiLU or 1/N;
:func:`grstack.kernels.triton_hstu.bias_channel_triton`): the ``triton`` backend runs that, fused, with no
[L, L] tensor. ``reference`` (and ``npu``) run the torch formulation per length group of the plan, one
[G, L, L] x [G, L, H·dv] matmul per group and channel; ``padded`` the dense oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grstack.kernels.attention import prefix_layout, select_backend
from grstack.kernels.bias import time_buckets
from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.jagged import jagged_to_padded, padded_to_jagged
from grstack.kernels.plan import (
    JaggedPlan,
    PrefixPlan,
    cached,
    gather_groups,
    make_plan,
    make_prefix_plan,
    scatter_groups,
    tensor_key,
)


def _check(pos_weight: torch.Tensor | None, time_weight: torch.Tensor | None) -> None:
    if pos_weight is None and time_weight is None:
        raise ValueError("bias_channel_attention needs pos_weight or time_weight (a channel with no bias is zero)")


def _indices(lengths: torch.Tensor, length: int, ts: torch.Tensor | None, num_targets: torch.Tensor | None,
             num_pos: int | None, num_tb: int | None, qts: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """For sequences of ``lengths`` padded to ``length``: the mask [G, L, L], the position-bias index and the
    time-bucket index (None when that bias is off). ``qts``: the query times (``ts`` when None)."""
    ar = torch.arange(length, device=lengths.device)
    hist = (lengths - num_targets).clamp(min=0) if num_targets is not None else lengths
    pos = torch.minimum(ar[None, :], hist[:, None])  # [G, L]
    diag = ar[None, :, None] == ar[None, None, :]
    allowed = (ar[None, :, None] >= ar[None, None, :]) & ((ar[None, None, :] < hist[:, None, None]) | diag)
    pos_idx = (pos[:, :, None] - pos[:, None, :]).clamp(0, num_pos - 1) if num_pos is not None else None
    if num_tb is not None and ts is not None:
        tb_idx = time_buckets((ts if qts is None else qts)[:, :, None] - ts[:, None, :], num_tb)
    else:
        tb_idx = None
    return allowed, pos_idx, tb_idx


def _weights(allowed: torch.Tensor, pos_idx: torch.Tensor | None, tb_idx: torch.Tensor | None,
             pos_weight: torch.Tensor | None, time_weight: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    w = None
    if pos_idx is not None:
        w = pos_weight[pos_idx]
    if tb_idx is not None:
        tw = time_weight[tb_idx]
        w = tw if w is None else w + tw
    if w is None:  # time channel without timestamps
        return allowed.to(dtype) * 0
    return (w * allowed).to(dtype)


def _sizes(pos_weight, time_weight, timestamps) -> tuple[int | None, int | None]:
    num_pos = pos_weight.numel() if pos_weight is not None else None
    num_tb = time_weight.numel() - 1 if time_weight is not None and timestamps is not None else None
    return num_pos, num_tb


def bias_channel_attention_reference(inputs: AttentionInputs, plan: JaggedPlan | None = None) -> torch.Tensor:
    """Jagged [sum_L, H, dv] in and out, per length group of ``plan`` (never padded to L_max); the masks and
    bias indices are built once per plan and reused by every layer."""
    v, pos_weight, time_weight, timestamps = inputs.v, inputs.pos_weight, inputs.time_weight, inputs.timestamps
    num_targets, query_timestamps = inputs.num_targets, inputs.query_timestamps
    _check(pos_weight, time_weight)
    plan = plan if plan is not None else make_plan(inputs.offsets)
    if not plan.groups:
        return v.new_zeros(v.shape)
    num_pos, num_tb = _sizes(pos_weight, time_weight, timestamps)

    qts = query_timestamps if num_tb is not None else None

    def build() -> list:
        none = [None] * len(plan.groups)
        ts_groups = gather_groups(timestamps, plan) if num_tb is not None else none
        qts_groups = gather_groups(qts, plan) if qts is not None else none
        return [_indices(g.lengths, g.max_len, ts, num_targets[g.seq] if num_targets is not None else None,
                         num_pos, num_tb, q) for g, ts, q in zip(plan.groups, ts_groups, qts_groups, strict=True)]

    key = ("fuxi_bias_channel", num_pos, num_tb, tensor_key(timestamps if num_tb is not None else None),
           tensor_key(num_targets), tensor_key(qts))
    per_group = cached(plan, key, build,
                       keep_alive=[t for t in (timestamps, num_targets, qts) if t is not None])
    outs = []
    for vb, (allowed, pos_idx, tb_idx) in zip(gather_groups(v, plan), per_group, strict=True):
        g, length, h, dv = vb.shape
        w = _weights(allowed, pos_idx, tb_idx, pos_weight, time_weight, vb.dtype)  # [G, L, L]
        outs.append(torch.bmm(w, vb.reshape(g, length, h * dv)).reshape(g, length, h, dv))
    return scatter_groups(outs, plan)


def bias_channel_attention_padded(inputs: AttentionInputs) -> torch.Tensor:
    """The dense padded formulation ([B, L_max, L_max] weights): the oracle of the grouped one."""
    v, offsets, pos_weight, time_weight = inputs.v, inputs.offsets, inputs.pos_weight, inputs.time_weight
    timestamps, num_targets, query_timestamps = inputs.timestamps, inputs.num_targets, inputs.query_timestamps
    _check(pos_weight, time_weight)
    if v.shape[0] == 0:
        return v.new_zeros(v.shape)
    lengths = offsets[1:] - offsets[:-1]
    vp = jagged_to_padded(v, offsets)  # [B, L, H, dv]
    b, length, h, dv = vp.shape
    num_pos, num_tb = _sizes(pos_weight, time_weight, timestamps)
    tp = jagged_to_padded(timestamps, offsets) if num_tb is not None else None
    qp = jagged_to_padded(query_timestamps, offsets) if num_tb is not None and query_timestamps is not None else None
    allowed, pos_idx, tb_idx = _indices(lengths, length, tp, num_targets, num_pos, num_tb, qp)
    w = _weights(allowed, pos_idx, tb_idx, pos_weight, time_weight, vp.dtype)
    out = torch.bmm(w, vp.reshape(b, length, h * dv)).reshape(b, length, h, dv)
    return padded_to_jagged(out, offsets)


def bias_channel_attention(
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    max_seq_len: int,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    plan: JaggedPlan | None = None,
    backend: str | None = None,
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """FuXi-α's bias-only attention channel (module docstring), jagged: v [sum_L, H, dv] -> [sum_L, H, dv].

    Differentiable in v, pos_weight and time_weight. ``backend`` as :func:`grstack.kernels.select_backend`:
    ``padded`` runs the dense oracle, every other backend the grouped torch formulation on its device.
    ``max_seq_len`` is :func:`grstack.kernels.hstu_attention`'s (the channels have no ``1/N``; distances are
    clamped to the position table's size, as there). ``query_timestamps`` [sum_L]: the time each token queries
    at, as :func:`grstack.kernels.hstu_attention`'s (the bucket of ``query_timestamps[i] - timestamps[j]``;
    FuXi-α's code uses the next event's time); None: the token's own timestamp.
    """
    inputs = AttentionInputs.channel(v, offsets, max_seq_len=max_seq_len, pos_weight=pos_weight,
                                     time_weight=time_weight, timestamps=timestamps, num_targets=num_targets,
                                     query_timestamps=query_timestamps)
    name = select_backend(v.device, backend)
    if name == "padded":
        return bias_channel_attention_padded(inputs)
    if name == "triton":
        from grstack.kernels import triton_hstu

        _check(pos_weight, time_weight)
        if not inputs.uses_time:  # the kernel's time bias needs both the table and the times
            inputs = inputs.replace(time_weight=None, timestamps=None, query_timestamps=None)
        return triton_hstu.bias_channel_triton(inputs)
    return bias_channel_attention_reference(inputs, plan)


def bias_channel_attention_with_prefix(
    v: torch.Tensor,
    offsets: torch.Tensor,
    v_prefix: Sequence[torch.Tensor],
    *,
    max_seq_len: int,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    prefix_timestamps: Sequence[torch.Tensor] | None = None,
    num_targets: torch.Tensor | None = None,
    plan: PrefixPlan | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Serving: the channel for new tokens after cached prefixes (forward; no gradient is promised).

    As :func:`grstack.kernels.hstu_attention_with_prefix`: sequence b's new tokens ``v[offsets[b]:offsets[b+1]]``
    sit at positions ``P_b..`` after a prefix whose values ``v_prefix[b]`` are in :func:`prefix_layout`'s layout
    for ``backend``; ``timestamps`` / ``prefix_timestamps[b]`` likewise; the last ``num_targets[b]`` new tokens
    are candidates. Equals :func:`bias_channel_attention`'s rows for the new tokens over the whole sequences.
    """
    _check(pos_weight, time_weight)
    batch = offsets.numel() - 1
    if len(v_prefix) != batch:
        raise ValueError(f"{len(v_prefix)} prefix values for {batch} sequences")
    num_pos, num_tb = _sizes(pos_weight, time_weight, timestamps)
    if num_tb is not None and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    layout = prefix_layout(v.device, backend)
    if plan is None:
        plan = make_prefix_plan(offsets, [layout.length(vp) for vp in v_prefix])
    if select_backend(v.device, backend) == "triton":
        from grstack.kernels import triton_hstu

        plens = torch.tensor(plan.prefix_lengths, dtype=torch.int64)
        poffsets = torch.zeros(batch + 1, dtype=torch.int64)
        poffsets[1:] = torch.cumsum(plens, 0)
        use_time = num_tb is not None
        inputs = AttentionInputs.channel(v, offsets, max_seq_len=max_seq_len, pos_weight=pos_weight,
                                         time_weight=time_weight if use_time else None,
                                         timestamps=timestamps if use_time else None, num_targets=num_targets)
        return triton_hstu.bias_channel_with_prefix_triton(
            inputs, torch.cat([layout.to_tokens(vp) for vp in v_prefix]), poffsets.to(v.device),
            torch.cat(list(prefix_timestamps)) if use_time else None)
    out = v.new_zeros(v.shape)
    offs = plan.offsets
    for b in range(batch):
        s0, s1 = offs[b], offs[b + 1]
        if s1 == s0:
            continue
        n_pre = plan.prefix_lengths[b]
        total = n_pre + s1 - s0
        nt = num_targets[b:b + 1] if num_targets is not None else None
        ts = torch.cat([prefix_timestamps[b], timestamps[s0:s1]])[None] if num_tb is not None else None
        lengths = torch.tensor([total], device=v.device)
        allowed, pos_idx, tb_idx = _indices(lengths, total, ts, nt, num_pos, num_tb)
        rows = slice(n_pre, total)
        w = _weights(allowed[:, rows], pos_idx[:, rows] if pos_idx is not None else None,
                     tb_idx[:, rows] if tb_idx is not None else None, pos_weight, time_weight, v.dtype)[0]
        vb = torch.cat([layout.to_tokens(v_prefix[b]), v[s0:s1]])  # [P + S, H, dv]
        out[s0:s1] = torch.matmul(w, vb.reshape(total, -1)).reshape(s1 - s0, *v.shape[1:])
    return out

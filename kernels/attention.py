"""The public ops with a backend dispatcher (reference / padded / triton / npu).

Models call only these: :func:`hstu_attention` (training and full inference), :func:`hstu_attention_with_prefix`
(serving: new tokens against a cached prefix), :func:`layer_norm_mul`, :func:`embedding_gather`, and
:func:`causal_softmax_attention` (the SASRec baseline). The backend is chosen by argument, else by the
``GRSTACK_KERNEL_BACKEND`` environment variable, else by device: ``triton`` on CUDA when it imports,
``npu`` when torch_npu imports and the tensors are on an NPU, ``reference`` (torch) otherwise. The attention
ops hand every backend one :class:`grstack.kernels.inputs.AttentionInputs` (the tensors and batch facts of the
call) instead of repeating them in each backend's signature.

Every backend implements both attention ops:

============  ===============================  ====================================  ====================
backend       hstu_attention                   hstu_attention_with_prefix            prefix K/V layout
============  ===============================  ====================================  ====================
reference     grouped torch engine (CPU fast)  torch prefix path (``prefix_cpu``)    head-major [H, P, d]
padded        dense padded formulation          plain [S, P+S] rectangles (oracle)    token-major [P, H, d]
triton        fused Triton kernels             fused Triton forward                  token-major [P, H, d]
npu           grouped torch engine on NPU      torch prefix path on NPU              head-major [H, P, d]
============  ===============================  ====================================  ====================
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from grstack.kernels.inputs import AttentionInputs, check_query_timestamps
from grstack.kernels.plan import (
    HEAD_MAJOR,
    TOKEN_MAJOR,
    JaggedPlan,
    PrefixLayout,
    PrefixPlan,
    cached,
    make_prefix_plan,
    tensor_key,
)
from grstack.kernels.prefix_cpu import hstu_attention_with_prefix_cpu
from grstack.kernels.reference import (
    causal_softmax_attention_reference,
    embedding_gather_reference,
    hstu_attention_padded,
    hstu_attention_reference,
    hstu_attention_with_prefix_reference,
    layer_norm_mul_reference,
)

BACKENDS = ("reference", "padded", "triton", "npu")
ENV_VAR = "GRSTACK_KERNEL_BACKEND"
_PREFIX_LAYOUTS = {"reference": HEAD_MAJOR, "padded": TOKEN_MAJOR, "triton": TOKEN_MAJOR, "npu": HEAD_MAJOR}


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(device: torch.device, requested: str | None = None) -> str:
    """Resolves the backend to use for tensors on ``device``."""
    choice = requested or os.environ.get(ENV_VAR) or "auto"
    if choice not in (*BACKENDS, "auto"):
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {', '.join(BACKENDS)} or auto")
    if choice != "auto":
        return choice
    if device.type == "cuda" and _triton_available():
        return "triton"
    if device.type == "npu":
        return "npu"
    return "reference"


def uses_plan(device: torch.device, backend: str | None = None) -> bool:
    """Whether the attention ops on ``device`` (``backend`` as :func:`select_backend`) read a
    :class:`JaggedPlan`: the grouped torch engines (``reference``, ``npu``) do; the fused Triton kernels and
    the padded oracle do not, so a model need not build one (a host read of the offsets) for them."""
    return select_backend(device, backend) in ("reference", "npu")


def hstu_attention(
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
    plan: JaggedPlan | None = None,
    backend: str | None = None,
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention (see :mod:`grstack.kernels.reference` for the exact math).

    q, k: [sum_L, H, dqk]; v: [sum_L, H, dv]; offsets: [B + 1]; returns [sum_L, H, dv]. Differentiable
    in q, k, v, pos_weight and time_weight. ``query_timestamps`` [sum_L] (int64, laid out like
    ``timestamps``): each query token's time in the time bias, ``bucket(query_timestamps[i] - timestamps[j])``
    (e.g. the time of the event after token i, Meta's convention); None: the token's own timestamp.
    """
    inputs = AttentionInputs(q, k, v, offsets, max_seq_len, timestamps=timestamps, pos_weight=pos_weight,
                             time_weight=time_weight, num_targets=num_targets, query_timestamps=query_timestamps)
    name = select_backend(q.device, backend)
    if name == "padded":
        return hstu_attention_padded(inputs)
    if name == "triton":
        from grstack.kernels import triton_hstu

        return triton_hstu.hstu_attention_triton(inputs)
    if name == "npu":
        from grstack.kernels import npu

        return npu.hstu_attention_npu(inputs, plan)
    return hstu_attention_reference(inputs, plan)


def prefix_layout(device: torch.device, backend: str | None = None) -> PrefixLayout:
    """The layout :func:`hstu_attention_with_prefix` wants each cached sequence's keys and values in, for
    tensors on ``device`` (and ``backend``, resolved as :func:`select_backend` does)."""
    return _PREFIX_LAYOUTS[select_backend(device, backend)]


def hstu_attention_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    k_prefix: Sequence[torch.Tensor],
    v_prefix: Sequence[torch.Tensor],
    *,
    max_seq_len: int,
    timestamps: torch.Tensor | None = None,
    prefix_timestamps: Sequence[torch.Tensor] | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    plan: PrefixPlan | None = None,
    backend: str | None = None,
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Serving attention of new tokens against a cached prefix (forward; no gradient is promised).

    Sequence b's new tokens ``q, k, v[offsets[b]:offsets[b+1]]`` (S_b of them) are positions
    ``P_b .. P_b + S_b - 1`` of a sequence whose first ``P_b`` tokens' keys and values are ``k_prefix[b]``,
    ``v_prefix[b]`` — one tensor per sequence, as a cache stores them, in :func:`prefix_layout`'s layout
    ([P_b, H, d] token-major or [H, P_b, d] head-major); ``timestamps`` [sum_S] / ``prefix_timestamps[b]``
    [P_b] likewise. ``num_targets`` [B] counts candidate tokens at the end of the new tokens (at most S_b).
    ``query_timestamps`` [sum_S]: the new tokens' query times in the time bias, as in :func:`hstu_attention`
    (the prefix's tokens are keys only; None: their own timestamps).
    The result equals the rows of the new tokens in :func:`hstu_attention` over the whole sequence (``N`` is
    constant, so the prefix's K/V do not depend on what follows it).

    On ``triton``, per-sequence tensors that are views of one storage (a serving KV arena's token ranges,
    in any order, with gaps) are read in place by start row and length; others are concatenated per call.

    ``plan`` (:func:`make_prefix_plan`, one per forward) lets every layer reuse what depends only on the
    batch (masks, bias indices, device offsets); without one each call builds its own.
    """
    name = select_backend(q.device, backend)
    batch = offsets.numel() - 1
    if len(k_prefix) != batch or len(v_prefix) != batch:
        raise ValueError(f"{len(k_prefix)} prefix keys and {len(v_prefix)} prefix values for {batch} sequences")
    if time_weight is not None and timestamps is not None and prefix_timestamps is None:
        raise ValueError("prefix_timestamps are required with timestamps and time_weight")
    check_query_timestamps(query_timestamps, timestamps)
    if plan is None:
        layout = _PREFIX_LAYOUTS[name]
        plan = make_prefix_plan(offsets, [layout.length(kp) for kp in k_prefix])
    if batch == 0 or q.shape[0] == 0:
        return v.new_zeros(v.shape)
    inputs = AttentionInputs(q, k, v, offsets, max_seq_len, timestamps=timestamps, pos_weight=pos_weight,
                             time_weight=time_weight, num_targets=num_targets, query_timestamps=query_timestamps)
    if name == "triton":
        return _prefix_triton(inputs, k_prefix, v_prefix, plan, prefix_timestamps)
    if name == "padded":
        return hstu_attention_with_prefix_reference(inputs, k_prefix, v_prefix, prefix_timestamps=prefix_timestamps,
                                                    plan=plan)
    if name == "npu":
        from grstack.kernels import npu

        return npu.hstu_attention_with_prefix_npu(inputs, k_prefix, v_prefix, prefix_timestamps=prefix_timestamps,
                                                  plan=plan)
    return hstu_attention_with_prefix_cpu(inputs, k_prefix, v_prefix, prefix_timestamps=prefix_timestamps, plan=plan)


def shared_base(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """When every non-empty part is a view of one storage along dim 0 with equal strides (a KV arena's token
    ranges), a view spanning them all and each part's first row in it (0 for an empty part); else None."""
    live = [p for p in parts if p.shape[0]]
    if not live:
        return (parts[0], [0] * len(parts)) if parts else None
    first = live[0]
    storage, stride, inner = first.untyped_storage().data_ptr(), first.stride(), first.shape[1:]
    if stride[-1] != 1 or stride[0] <= 0:
        return None
    for p in live:
        if (p.untyped_storage().data_ptr() != storage or p.stride() != stride or p.shape[1:] != inner
                or p.dtype != first.dtype):
            return None
    lo = min(p.storage_offset() for p in live)
    if any((p.storage_offset() - lo) % stride[0] for p in live):
        return None
    rows = max((p.storage_offset() - lo) // stride[0] + p.shape[0] for p in live)
    base = first.as_strided((rows, *inner), stride, lo)
    return base, [(p.storage_offset() - lo) // stride[0] if p.shape[0] else 0 for p in parts]


def _prefix_triton(inputs: AttentionInputs, k_prefix: Sequence[torch.Tensor], v_prefix: Sequence[torch.Tensor],
                   plan: PrefixPlan, prefix_timestamps: Sequence[torch.Tensor] | None) -> torch.Tensor:
    """The fused kernel reads each sequence's prefix from a start row and a length in one [T, H, d] tensor
    per layer. When the per-sequence tensors are views of one KV arena (and the timestamps of its timestamp
    row, at the same rows) they are read in place: no copy. Otherwise they are concatenated per layer (the
    prefix offsets and timestamps once per plan)."""
    from grstack.kernels import triton_hstu

    device = inputs.q.device
    arena = [shared_base(k_prefix), shared_base(v_prefix)]
    if prefix_timestamps is not None:
        arena.append(shared_base(prefix_timestamps))
    if all(a is not None for a in arena) and all(a[1] == arena[0][1] for a in arena):
        starts_list = arena[0][1]

        def arena_addressing() -> tuple[torch.Tensor, torch.Tensor]:
            starts = torch.tensor(starts_list, dtype=torch.int64)
            lengths = torch.tensor(plan.prefix_lengths, dtype=torch.int64)
            return starts.to(device), lengths.to(device)

        starts, lengths = cached(plan, ("triton_prefix_arena", device, tuple(starts_list)), arena_addressing)
        pts = arena[2][0] if prefix_timestamps is not None else None
        return triton_hstu.hstu_attention_with_prefix_triton(
            inputs, arena[0][0], arena[1][0], prefix_starts=starts, prefix_lengths=lengths, prefix_timestamps=pts)

    def join(parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts))

    def prefix_offsets() -> torch.Tensor:
        lengths = torch.tensor(plan.prefix_lengths, dtype=torch.int64)
        return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)

    poffsets = cached(plan, ("triton_prefix_offsets", device), prefix_offsets)
    pts = None
    if prefix_timestamps is not None:
        pts = cached(plan, ("triton_prefix_timestamps", *(tensor_key(t) for t in prefix_timestamps)),
                     lambda: join(prefix_timestamps), keep_alive=list(prefix_timestamps))
    return triton_hstu.hstu_attention_with_prefix_triton(inputs, join(k_prefix), join(v_prefix), poffsets,
                                                         prefix_timestamps=pts)


def layer_norm_mul(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float = 1e-6, *, backend: str | None = None) -> torch.Tensor:
    """``LayerNorm(x) * u`` (HSTU's normalised attention output gated by U)."""
    if select_backend(x.device, backend) == "triton":
        from grstack.kernels import triton_norm

        return triton_norm.layer_norm_mul_triton(x, u, weight, bias, eps)
    return layer_norm_mul_reference(x, u, weight, bias, eps)


def embedding_gather(table: torch.Tensor, ids: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Padding-free embedding lookup for flat jagged ids."""
    if select_backend(table.device, backend) == "triton":
        from grstack.kernels import triton_embedding

        return triton_embedding.embedding_gather_triton(table, ids)
    return embedding_gather_reference(table, ids)


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *,
                             plan: JaggedPlan | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Jagged causal softmax attention (the SASRec baseline), [sum_L, H, d] -> [sum_L, H, d]; torch on every
    device, per length group of ``plan`` (no padding to L_max)."""
    return causal_softmax_attention_reference(q, k, v, offsets, plan=plan, dropout_p=dropout_p)


def tuned_configs() -> list[dict]:
    """The fused kernels' tile configurations the autotuner picked in this process (one per shape key)."""
    from grstack.kernels import triton_tuning

    return [{"kernel": key.kernel, "dtype": key.dtype, "block_d": max(key.block_dqk, key.block_dv),
             "features": list(key.features), "max_len_bucket": key.max_len_bucket, "block_m": cfg.block_m,
             "block_n": cfg.block_n, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
            for key, cfg in triton_tuning.chosen().items()]

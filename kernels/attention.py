"""One public attention function with a backend dispatcher (reference / triton / npu).

The model calls only :func:`hstu_attention`. The backend is chosen by argument, else by the
``GRSTACK_KERNEL_BACKEND`` environment variable, else by device: ``triton`` on CUDA when it imports,
``npu`` when torch_npu imports and the tensors are on an NPU, ``reference`` (torch) otherwise.
"""

from __future__ import annotations

import os

import torch

from grstack.kernels.plan import JaggedPlan
from grstack.kernels.reference import (
    embedding_gather_reference,
    hstu_attention_padded,
    hstu_attention_reference,
    hstu_attention_with_prefix_reference,
    layer_norm_mul_reference,
)

BACKENDS = ("reference", "padded", "triton", "npu")
ENV_VAR = "GRSTACK_KERNEL_BACKEND"


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
) -> torch.Tensor:
    """Jagged HSTU attention (see :mod:`grstack.kernels.reference` for the exact math).

    q, k: [sum_L, H, dqk]; v: [sum_L, H, dv]; offsets: [B + 1]; returns [sum_L, H, dv]. Differentiable
    in q, k, v, pos_weight and time_weight.
    """
    kwargs = dict(max_seq_len=max_seq_len, timestamps=timestamps, pos_weight=pos_weight,
                  time_weight=time_weight, num_targets=num_targets)
    name = select_backend(q.device, backend)
    if name == "padded":
        return hstu_attention_padded(q, k, v, offsets, **kwargs)
    if name == "triton":
        from grstack.kernels import triton_hstu

        return triton_hstu.hstu_attention_triton(q, k, v, offsets, **kwargs)
    if name == "npu":
        from grstack.kernels import npu

        return npu.hstu_attention_npu(q, k, v, offsets, plan=plan, **kwargs)
    return hstu_attention_reference(q, k, v, offsets, plan=plan, **kwargs)


def hstu_attention_with_prefix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    prefix_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    timestamps: torch.Tensor | None = None,
    prefix_timestamps: torch.Tensor | None = None,
    pos_weight: torch.Tensor | None = None,
    time_weight: torch.Tensor | None = None,
    num_targets: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Serving attention of new tokens against a cached prefix (forward only).

    Sequence b's new tokens ``q, k, v[offsets[b]:offsets[b+1]]`` (S_b of them) are positions
    ``P_b .. P_b + S_b - 1`` of a sequence whose first ``P_b`` tokens' keys and values are
    ``k_prefix, v_prefix[prefix_offsets[b]:prefix_offsets[b+1]]``; ``timestamps`` / ``prefix_timestamps``
    likewise. ``num_targets`` [B] counts candidate tokens at the end of the new tokens. The result equals
    the rows of the new tokens in :func:`hstu_attention` over the whole sequence (``N`` is constant, so the
    prefix's K/V do not depend on what follows it).
    """
    kwargs = dict(max_seq_len=max_seq_len, timestamps=timestamps, prefix_timestamps=prefix_timestamps,
                  pos_weight=pos_weight, time_weight=time_weight, num_targets=num_targets)
    if select_backend(q.device, backend) == "triton":
        from grstack.kernels import triton_hstu

        return triton_hstu.hstu_attention_with_prefix_triton(q, k, v, offsets, k_prefix, v_prefix,
                                                             prefix_offsets, **kwargs)
    return hstu_attention_with_prefix_reference(q, k, v, offsets, k_prefix, v_prefix, prefix_offsets, **kwargs)


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

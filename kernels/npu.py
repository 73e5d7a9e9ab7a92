"""Ascend NPU path (needs torch_npu).

torch_npu's fused attention (``npu_fusion_attention``) is softmax attention; it has no pointwise-SiLU
attention with a relative position/time bias, so HSTU attention runs as the length-bucketed torch
reference on NPU tensors (batched matmuls per length group — no padding to L_max, no [B, L_max, L_max]
bias), and cached-prefix attention as the torch prefix path (:mod:`grstack.kernels.prefix_cpu`). Layer norm and embedding lookup use torch's own NPU kernels through the reference functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grstack.kernels.plan import JaggedPlan, PrefixPlan
from grstack.kernels.prefix_cpu import hstu_attention_with_prefix_cpu
from grstack.kernels.reference import hstu_attention_reference


def _require_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("the npu kernel backend needs torch_npu (pip install torch_npu on an Ascend host)") \
            from exc


def hstu_attention_npu(
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
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention on an NPU; same signature and math as the reference."""
    _require_torch_npu()
    return hstu_attention_reference(q, k, v, offsets, max_seq_len=max_seq_len, timestamps=timestamps,
                                    pos_weight=pos_weight, time_weight=time_weight, num_targets=num_targets,
                                    plan=plan, query_timestamps=query_timestamps)


def hstu_attention_with_prefix_npu(
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
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cached-prefix attention on an NPU (head-major prefix K/V, like the CPU path)."""
    _require_torch_npu()
    return hstu_attention_with_prefix_cpu(q, k, v, offsets, k_prefix, v_prefix, max_seq_len=max_seq_len,
                                          timestamps=timestamps, prefix_timestamps=prefix_timestamps,
                                          pos_weight=pos_weight, time_weight=time_weight,
                                          num_targets=num_targets, plan=plan,
                                          query_timestamps=query_timestamps)

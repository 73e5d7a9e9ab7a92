"""Ascend NPU path (needs torch_npu).

torch_npu's fused attention (``npu_fusion_attention``) is softmax attention; it has no pointwise-SiLU
attention with a relative position/time bias, so HSTU attention runs as the length-bucketed torch
reference on NPU tensors (batched matmuls per length group — no padding to L_max, no [B, L_max, L_max]
bias), and cached-prefix attention as the torch prefix path (:mod:`grstack.kernels.prefix_cpu`). Layer norm and embedding lookup use torch's own NPU kernels through the reference functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.plan import JaggedPlan, PrefixPlan
from grstack.kernels.prefix_cpu import hstu_attention_with_prefix_cpu
from grstack.kernels.reference import hstu_attention_reference


def _require_torch_npu() -> None:
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("the npu kernel backend needs torch_npu (pip install torch_npu on an Ascend host)") \
            from exc


def hstu_attention_npu(inputs: AttentionInputs, plan: JaggedPlan | None = None) -> torch.Tensor:
    """Jagged HSTU attention on an NPU; same signature and math as the reference."""
    _require_torch_npu()
    return hstu_attention_reference(inputs, plan)


def hstu_attention_with_prefix_npu(
    inputs: AttentionInputs,
    k_prefix: Sequence[torch.Tensor],
    v_prefix: Sequence[torch.Tensor],
    *,
    prefix_timestamps: Sequence[torch.Tensor] | None = None,
    plan: PrefixPlan | None = None,
) -> torch.Tensor:
    """Cached-prefix attention on an NPU (head-major prefix K/V, like the CPU path)."""
    _require_torch_npu()
    return hstu_attention_with_prefix_cpu(inputs, k_prefix, v_prefix, prefix_timestamps=prefix_timestamps,
                                          plan=plan)

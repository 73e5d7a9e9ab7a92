"""Jagged kernels for HSTU: a torch reference, fused Triton kernels, NPU paths, one dispatcher."""

from grstack.kernels.attention import (
    embedding_gather,
    hstu_attention,
    hstu_attention_with_prefix,
    layer_norm_mul,
    select_backend,
)
from grstack.kernels.plan import JaggedPlan, make_plan

__all__ = [
    "JaggedPlan",
    "embedding_gather",
    "hstu_attention",
    "hstu_attention_with_prefix",
    "layer_norm_mul",
    "make_plan",
    "select_backend",
]

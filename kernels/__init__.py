"""Jagged kernels for HSTU: a torch reference, fused Triton kernels, NPU paths, one dispatcher.

Everything outside this package imports from here (``from grstack import kernels`` or
``from grstack.kernels import X``), never from a submodule; nothing here imports the runtime.
"""

from grstack.kernels.attention import (
    BACKENDS,
    ENV_VAR,
    causal_softmax_attention,
    embedding_gather,
    hstu_attention,
    hstu_attention_with_prefix,
    layer_norm_mul,
    prefix_layout,
    select_backend,
    tuned_configs,
    uses_plan,
)
from grstack.kernels.bias import TIME_BUCKET_DIV, time_buckets
from grstack.kernels.fuxi import bias_channel_attention, bias_channel_attention_with_prefix
from grstack.kernels.host_syncs import METHOD as HOST_SYNC_METHOD
from grstack.kernels.host_syncs import HostSyncCount, count_host_syncs
from grstack.kernels.inputs import AttentionInputs
from grstack.kernels.jagged import (
    jagged_to_padded,
    lengths_to_offsets,
    padded_to_jagged,
    positions,
    segment_ids,
)
from grstack.kernels.plan import (
    HEAD_MAJOR,
    TOKEN_MAJOR,
    JaggedPlan,
    PrefixLayout,
    PrefixPlan,
    make_plan,
    make_prefix_plan,
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "HEAD_MAJOR",
    "HOST_SYNC_METHOD",
    "TIME_BUCKET_DIV",
    "TOKEN_MAJOR",
    "AttentionInputs",
    "HostSyncCount",
    "JaggedPlan",
    "PrefixLayout",
    "PrefixPlan",
    "bias_channel_attention",
    "bias_channel_attention_with_prefix",
    "causal_softmax_attention",
    "count_host_syncs",
    "embedding_gather",
    "hstu_attention",
    "hstu_attention_with_prefix",
    "jagged_to_padded",
    "layer_norm_mul",
    "lengths_to_offsets",
    "make_plan",
    "make_prefix_plan",
    "padded_to_jagged",
    "positions",
    "prefix_layout",
    "segment_ids",
    "select_backend",
    "time_buckets",
    "tuned_configs",
    "uses_plan",
]

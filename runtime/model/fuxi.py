"""FuXi-α (Ye et al. 2025, "FuXi-α: Scaling Recommendation Model with Feature Interaction Enhanced
Transformer"): HSTU's model with the FuXi block, on jagged input.

Per block, with X jagged [sum_L, d] and C channels (semantic, plus positional and temporal when their bias
is on)::

    U, V, Q, K = split(SiLU(W_uvqk · RMSNorm(X)))          # U: [C·H·dv], V: [H·dv] shared by every channel
    A_pos      = bias_channel_attention(V; pos_w)          # weights: the relative-position bias, masked
    A_time     = bias_channel_attention(V; time_w)         # weights: the time-gap bucket's bias, masked
    A_sem      = hstu_attention(Q, K, V)                   # SiLU(QK^T) * mask / N, no bias
    Y          = RMSNorm(concat(A_pos, A_time, A_sem)) ⊙ U  # adaptive multi-channel self-attention
    X1         = W0 · dropout(Y) + X                       # multi-stage FFN, stage 1
    Z          = dropout(RMSNorm(X1))
    X'         = W2 · (SiLU(W1 · Z) ⊙ (W3 · Z)) + X1       # stage 2: SwiGLU

Everything else (embeddings, heads, the relay-serving methods) is :class:`grstack.runtime.model.HSTU`'s: the
positional and temporal channels' weights depend only on positions and timestamps and they read the same
V as the semantic channel, so a cached prefix's per-layer K and V are all the cached-prefix forward needs,
as for HSTU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grstack import kernels
from grstack.runtime.data import JaggedBatch
from grstack.runtime.model.hstu import HSTU, next_event_timestamps
from grstack.runtime.model.side_features import ItemFeatureMap

_EPS = 1e-6


class FuXiLayer(nn.Module):
    """One FuXi-α block (AMS + MFFN); the interface of :class:`grstack.runtime.model.hstu.HSTULayer`."""

    def __init__(self, d_model: int, num_heads: int, dqk: int, dv: int, dropout: float, max_seq_len: int,
                 time_buckets: int, position_bias: bool, time_bias: bool, ffn_mult: int) -> None:
        super().__init__()
        self.d_model, self.num_heads, self.dqk, self.dv, self.max_seq_len = d_model, num_heads, dqk, dv, max_seq_len
        self.num_channels = 1 + int(position_bias) + int(time_bias)
        self.dropout = dropout
        hv = num_heads * dv
        # FuXi-α's projection: one bias-free matrix, N(0, 0.02); U gates all C channels, V is shared by them.
        self.uvqk = nn.Linear(d_model, self.num_channels * hv + hv + 2 * num_heads * dqk, bias=False)
        self.pos_weight = nn.Parameter(torch.randn(max_seq_len) * 0.02) if position_bias else None
        self.time_weight = nn.Parameter(torch.randn(time_buckets + 1) * 0.02) if time_bias else None
        hidden = d_model * ffn_mult
        self.lin0 = nn.Linear(self.num_channels * hv, d_model)
        self.lin1 = nn.Linear(d_model, hidden, bias=False)
        self.lin2 = nn.Linear(hidden, d_model, bias=False)
        self.lin3 = nn.Linear(d_model, hidden, bias=False)
        nn.init.normal_(self.uvqk.weight, std=0.02)
        for lin in (self.lin0, self.lin1, self.lin2, self.lin3):
            nn.init.xavier_uniform_(lin.weight)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """U [N, C*H*dv], V [N, H, dv], Q [N, H, dqk], K [N, H, dqk] (what the relay cache stores: K, V)."""
        n, h = x.shape[0], self.num_heads
        uvqk = F.silu(self.uvqk(F.rms_norm(x, (self.d_model,), eps=_EPS)))
        u, v, q, k = torch.split(uvqk, [self.num_channels * h * self.dv, h * self.dv, h * self.dqk, h * self.dqk],
                                 dim=-1)
        return u, v.reshape(n, h, self.dv), q.reshape(n, h, self.dqk), k.reshape(n, h, self.dqk)

    def finish(self, x: torch.Tensor, channels: list[torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """Channels in FuXi-α's order (positional, temporal, semantic) -> the block's output."""
        a = torch.cat([c.reshape(x.shape[0], -1) for c in channels], dim=-1)
        y = F.rms_norm(a, (a.shape[-1],), eps=_EPS) * u
        x1 = self.lin0(F.dropout(y, self.dropout, self.training)) + x
        z = F.dropout(F.rms_norm(x1, (self.d_model,), eps=_EPS), self.dropout, self.training)
        return self.lin2(F.silu(self.lin1(z)) * self.lin3(z)) + x1

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None,
                num_targets: torch.Tensor | None, plan: kernels.JaggedPlan | None,
                query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        """``query_timestamps``: the temporal channel's query times (``time_bias_query=next``); the semantic
        channel has no bias, so only the temporal one reads them."""
        u, v, q, k = self.project(x)
        kw = dict(max_seq_len=self.max_seq_len, num_targets=num_targets, plan=plan)
        channels = []
        if self.pos_weight is not None:
            channels.append(kernels.bias_channel_attention(v, offsets, pos_weight=self.pos_weight, **kw))
        if self.time_weight is not None:
            channels.append(kernels.bias_channel_attention(v, offsets, time_weight=self.time_weight,
                                                           timestamps=timestamps,
                                                           query_timestamps=query_timestamps, **kw))
        channels.append(kernels.hstu_attention(q, k, v, offsets, **kw))
        return self.finish(x, channels, u)

    def forward_with_prefix(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None,
                            num_targets: torch.Tensor | None, k_prefix: Sequence[torch.Tensor],
                            v_prefix: Sequence[torch.Tensor], prefix_timestamps: Sequence[torch.Tensor] | None,
                            plan: kernels.PrefixPlan, backend: str | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block on new tokens after cached prefixes (per sequence K/V of this layer); returns the output
        and the new tokens' K [n, H, dqk] and V [n, H, dv]."""
        u, v, q, k = self.project(x)
        kw = dict(max_seq_len=self.max_seq_len, num_targets=num_targets, plan=plan, backend=backend)
        channels = []
        if self.pos_weight is not None:
            channels.append(kernels.bias_channel_attention_with_prefix(v, offsets, v_prefix,
                                                                       pos_weight=self.pos_weight, **kw))
        if self.time_weight is not None:
            channels.append(kernels.bias_channel_attention_with_prefix(
                v, offsets, v_prefix, time_weight=self.time_weight, timestamps=timestamps,
                prefix_timestamps=prefix_timestamps, **kw))
        channels.append(kernels.hstu_attention_with_prefix(q, k, v, offsets, k_prefix, v_prefix, **kw))
        return self.finish(x, channels, u), k, v


class FuXiAlpha(HSTU):
    """Retrieval + ranking FuXi-α over jagged sequences of item ids (HSTU's interface and heads).

    ``ffn_mult``: the SwiGLU stage's hidden width as a multiple of ``d_model`` (FuXi-α's ``ffn_multiply``,
    1 in its MovieLens configs). ``time_bias_query``: HSTU's option, for the temporal channel (``next`` is
    FuXi-α's code's convention: the gap from each key event to the event being predicted).
    """

    def __init__(self, num_items: int, *, max_len: int, d_model: int = 64, num_blocks: int = 4,
                 num_heads: int = 4, dqk: int = 16, dv: int = 16, dropout: float = 0.5,
                 input_dropout: float = 0.5, time_buckets: int = 128, position_bias: bool = True,
                 time_bias: bool = True, num_tasks: int = 1, ranking_head: bool = True,
                 item_table: bool = True, ffn_mult: int = 1, item_features: ItemFeatureMap | None = None,
                 user_features: dict[str, int] | None = None, action_inputs: bool = False,
                 time_bias_query: str = "self") -> None:
        # HSTU's embeddings and heads with no HSTU blocks (num_blocks=0); the FuXi-α blocks replace them.
        super().__init__(num_items, max_len=max_len, d_model=d_model, num_blocks=0, num_heads=num_heads,
                         dqk=dqk, dv=dv, dropout=dropout, input_dropout=input_dropout, time_buckets=time_buckets,
                         position_bias=position_bias, time_bias=time_bias, num_tasks=num_tasks,
                         ranking_head=ranking_head, item_table=item_table, item_features=item_features,
                         user_features=user_features, action_inputs=action_inputs,
                         time_bias_query=time_bias_query)
        self.layers = nn.ModuleList(
            FuXiLayer(d_model, num_heads, dqk, dv, dropout, self.max_seq_len, time_buckets, position_bias,
                      time_bias, ffn_mult)
            for _ in range(num_blocks))

    def encode(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None,
               context_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[sum_L, d] outputs for every token. The plan (from the batch's host lengths, then one copy; a read
        of the offsets only for a batch built on a device without them) is made only where the kernels read it (:func:`grstack.kernels.uses_plan`: the grouped torch engines, where the
        positional and temporal channels run per length group too); one plan per batch serves every layer and
        channel. The fused Triton kernels need none: no host read on that path."""
        x, offsets, ts, keep = self.embed_batch(batch, item_rows, context_rows)
        plan = (kernels.make_plan(offsets, lengths=batch.host_lengths_with_context(self.num_context))
                if kernels.uses_plan(offsets.device) else None)
        ts = ts if self._uses_time() else None
        qts = next_event_timestamps(ts, offsets, batch.num_targets) if ts is not None and \
            self.time_bias_query == "next" else None
        for layer in self.layers:
            x = layer(x, offsets, ts, batch.num_targets, plan, qts)
        return x if keep is None else x[keep]

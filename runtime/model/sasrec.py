"""SASRec (Kang & McAuley 2018), the baseline: softmax causal self-attention, learned absolute positions.

Attention is :func:`grstack.kernels.causal_softmax_attention`, per length group of the jagged plan (no
[B, L_max] padding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from grstack import kernels
from grstack.runtime.data import JaggedBatch
from grstack.runtime.model.hstu import action_input_bits
from grstack.runtime.model.item_rows import ITEM_INIT_STD
from grstack.runtime.model.side_features import ItemFeatureMap, ItemTokens


class SASRecBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float, ffn_mult: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model, eps=1e-8)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-8)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_mult * d_model), nn.GELU(),
                                 nn.Dropout(dropout), nn.Linear(ffn_mult * d_model, d_model))
        self.dropout = dropout

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, plan: kernels.JaggedPlan) -> torch.Tensor:
        n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(n, 3, self.num_heads, d // self.num_heads).unbind(1)
        a = kernels.causal_softmax_attention(q, k, v, offsets, plan=plan,
                                             dropout_p=self.dropout if self.training else 0.0).reshape(n, d)
        x = x + F.dropout(self.proj(a), self.dropout, self.training)
        return x + F.dropout(self.ffn(self.norm2(x)), self.dropout, self.training)


class SASRec(ItemTokens):
    """SASRec; with ``item_features`` its item tokens carry pooled side features as HSTU's do."""

    def __init__(self, num_items: int, *, max_len: int, d_model: int = 64, num_blocks: int = 2,
                 num_heads: int = 2, dropout: float = 0.5, input_dropout: float = 0.5, ffn_mult: int = 1,
                 item_table: bool = True, item_features: ItemFeatureMap | None = None,
                 user_features: dict[str, int] | None = None, action_inputs: bool = False, num_tasks: int = 1,
                 **_: object) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.num_heads={num_heads}")
        self.num_items, self.max_len, self.d_model = num_items, max_len, d_model
        self._init_item_table(num_items, d_model, item_table, item_features, user_features,
                              action_bits=action_input_bits(action_inputs, num_tasks))
        self.pos_emb = nn.Embedding(max_len + 1, d_model)
        self.input_dropout = input_dropout
        self.blocks = nn.ModuleList(SASRecBlock(d_model, num_heads, dropout, ffn_mult) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(d_model, eps=1e-8)
        self.rank_head = None
        self.num_tasks = 0
        if item_table:
            nn.init.trunc_normal_(self.item_emb.weight, std=ITEM_INIT_STD)
        nn.init.trunc_normal_(self.pos_emb.weight, std=0.02)

    def encode(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None,
               context_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``item_rows``: the tokens' rows (:meth:`token_rows`) when looked up elsewhere (the sharded embedding);
        ``context_rows``: the contextual tokens' (:meth:`context_rows`), which head each sequence."""
        pos = kernels.positions(batch.offsets, batch.item_ids.numel()).clamp(max=self.max_len)
        if item_rows is None:
            item_rows = self.token_rows(batch.item_ids)
        x = item_rows * math.sqrt(self.d_model) + self.pos_emb(pos)
        actions = self.action_vectors(batch.input_actions)
        if actions is not None:
            x = x + actions
        x = F.dropout(x, self.input_dropout, self.training)
        offsets, keep = batch.offsets, None
        if self.context is not None:
            if context_rows is None:
                if batch.context is None:
                    raise ValueError("the model reads user context: the batch has none")
                context_rows = self.context_rows(batch.context)
            ctx = F.dropout(context_rows * math.sqrt(self.d_model), self.input_dropout, self.training)
            x, offsets, _, keep = self.with_context(x, offsets, batch.timestamps, ctx)
        # the softmax attention runs per length group on every device, so it needs the plan: one per forward
        # for every block, built from the batch's host lengths (no read of the offsets) and moved in one copy
        plan = kernels.make_plan(offsets, lengths=batch.host_lengths_with_context(self.num_context))
        for block in self.blocks:
            x = block(x, offsets, plan)
        x = self.norm(x)
        return x if keep is None else x[keep]

    def item_vectors(self, ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            return F.normalize(rows, dim=-1)
        w = self.item_table_weight() if ids is None else kernels.embedding_gather(self.item_emb.weight, ids)
        return F.normalize(w, dim=-1)

    def query_vectors(self, outputs: torch.Tensor) -> torch.Tensor:
        return F.normalize(outputs, dim=-1)

"""HSTU (DESIGN §3): SiLU pointwise attention with relative position/time bias and U-gating, on jagged input.

Per layer, with X jagged [sum_L, d]::

    U, V, Q, K = split(SiLU(W1 · LN(X)))
    A          = hstu_attention(Q, K, V)              # grstack.kernels: SiLU(QK^T + rab) * mask / N, then ·V
    X'         = X + W2 · dropout(LN(A) ⊙ U)

Heads: retrieval (every history token's output, L2-normalised, scores the next item) and ranking
(M candidate tokens appended after the history attend to the history and themselves; an MLP gives one
logit per task).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from grstack import kernels
from grstack.runtime.data.jagged import JaggedBatch, positions


class HSTULayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dqk: int, dv: int, dropout: float, max_seq_len: int,
                 time_buckets: int, position_bias: bool, time_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.dqk, self.dv, self.max_seq_len = num_heads, dqk, dv, max_seq_len
        # Layer norms without affine parameters and a small-normal U/V/Q/K projection (std 0.02) make each
        # layer start close to the identity on the residual path; Xavier-sized projections here train
        # markedly worse on sparse data such as Amazon Beauty.
        self.norm_in = nn.LayerNorm(d_model, eps=1e-6, elementwise_affine=False)
        self.uvqk = nn.Linear(d_model, num_heads * (2 * dv + 2 * dqk))
        self.norm_attn = nn.LayerNorm(num_heads * dv, eps=1e-6, elementwise_affine=False)
        self.out = nn.Linear(num_heads * dv, d_model)
        self.dropout = dropout
        self.pos_weight = nn.Parameter(torch.randn(max_seq_len) * 0.02) if position_bias else None
        self.time_weight = nn.Parameter(torch.randn(time_buckets + 1) * 0.02) if time_bias else None
        nn.init.normal_(self.uvqk.weight, std=0.02)
        nn.init.zeros_(self.uvqk.bias)
        nn.init.xavier_uniform_(self.out.weight)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """U [N, H*dv], V [N, H, dv], Q [N, H, dqk], K [N, H, dqk] (what the relay cache stores: K, V)."""
        n, h = x.shape[0], self.num_heads
        uvqk = F.silu(self.uvqk(self.norm_in(x)))
        u, v, q, k = torch.split(uvqk, [h * self.dv, h * self.dv, h * self.dqk, h * self.dqk], dim=-1)
        return u, v.reshape(n, h, self.dv), q.reshape(n, h, self.dqk), k.reshape(n, h, self.dqk)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        y = kernels.layer_norm_mul(attn.reshape(x.shape[0], -1), u, self.norm_attn.weight,
                                   self.norm_attn.bias, self.norm_attn.eps)
        return x + self.out(F.dropout(y, self.dropout, self.training))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None,
                num_targets: torch.Tensor | None, plan: kernels.JaggedPlan | None) -> torch.Tensor:
        u, v, q, k = self.project(x)
        attn = kernels.hstu_attention(
            q, k, v, offsets, max_seq_len=self.max_seq_len, timestamps=timestamps,
            pos_weight=self.pos_weight, time_weight=self.time_weight, num_targets=num_targets, plan=plan)
        return self.finish(x, attn, u)


class HSTU(nn.Module):
    """Retrieval + ranking HSTU over jagged sequences of item ids."""

    def __init__(self, num_items: int, *, max_len: int, d_model: int = 64, num_blocks: int = 4,
                 num_heads: int = 4, dqk: int = 16, dv: int = 16, dropout: float = 0.5,
                 input_dropout: float = 0.5, time_buckets: int = 128, position_bias: bool = True,
                 time_bias: bool = True, num_tasks: int = 1, ranking_head: bool = True) -> None:
        super().__init__()
        self.num_items, self.max_len, self.d_model = num_items, max_len, d_model
        # Candidates sit at position hist_len <= max_len, hence max_len + 1 positions.
        self.max_seq_len = max_len + 1
        self.item_emb = nn.Embedding(num_items + 1, d_model)
        self.pos_emb = nn.Embedding(self.max_seq_len, d_model)
        self.input_dropout = input_dropout
        self.layers = nn.ModuleList(
            HSTULayer(d_model, num_heads, dqk, dv, dropout, self.max_seq_len, time_buckets, position_bias,
                      time_bias)
            for _ in range(num_blocks))
        self.num_tasks = num_tasks
        self.rank_head = (nn.Sequential(nn.Linear(2 * d_model, d_model), nn.SiLU(), nn.Linear(d_model, num_tasks))
                          if ranking_head else None)
        nn.init.trunc_normal_(self.item_emb.weight, std=0.02)
        nn.init.trunc_normal_(self.pos_emb.weight, std=d_model**-0.5)

    def token_positions(self, batch: JaggedBatch) -> torch.Tensor:
        pos = positions(batch.offsets)
        if batch.num_targets is not None:
            from grstack.runtime.data.jagged import segment_ids

            hist = (batch.lengths - batch.num_targets)[segment_ids(batch.offsets)]
            pos = torch.minimum(pos, hist)
        return pos.clamp(max=self.max_seq_len - 1)

    def embed_tokens(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``item_rows`` ([sum_L, d], optional): the tokens' item-embedding rows looked up elsewhere (the
        sharded embedding of distributed training); else they are gathered from ``item_emb``."""
        if item_rows is None:
            item_rows = kernels.embedding_gather(self.item_emb.weight, batch.item_ids)
        x = item_rows * math.sqrt(self.d_model) + self.pos_emb(self.token_positions(batch))
        return F.dropout(x, self.input_dropout, self.training)

    def encode(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[sum_L, d] outputs for every token (history and candidates)."""
        plan = kernels.make_plan(batch.offsets) if batch.item_ids.device.type == "cpu" else None
        x = self.embed_tokens(batch, item_rows)
        ts = batch.timestamps if any(layer.time_weight is not None for layer in self.layers) else None
        for layer in self.layers:
            x = layer(x, batch.offsets, ts, batch.num_targets, plan)
        return x

    def item_vectors(self, ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalised item vectors the retrieval head scores against (all items when ids is None);
        ``rows`` are already looked-up embedding rows to normalise instead."""
        if rows is not None:
            return F.normalize(rows, dim=-1)
        w = self.item_emb.weight if ids is None else kernels.embedding_gather(self.item_emb.weight, ids)
        return F.normalize(w, dim=-1)

    def query_vectors(self, outputs: torch.Tensor) -> torch.Tensor:
        return F.normalize(outputs, dim=-1)

    def rank_logits(self, cand_outputs: torch.Tensor, cand_ids: torch.Tensor,
                    cand_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[M, num_tasks] logits from candidate-token outputs and the candidates' item vectors
        (``cand_rows``: those rows looked up elsewhere)."""
        if self.rank_head is None:
            raise RuntimeError("this model was built without a ranking head")
        rows = cand_rows if cand_rows is not None else self.item_emb(cand_ids)
        feats = torch.cat([cand_outputs, rows], dim=-1)
        return self.rank_head(feats)

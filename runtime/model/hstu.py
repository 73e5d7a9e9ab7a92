"""HSTU (docs/architecture.md §3): SiLU pointwise attention with relative position/time bias and U-gating,
on jagged input.

Per layer, with X jagged [sum_L, d]::

    U, V, Q, K = split(SiLU(W1 · LN(X)))
    A          = hstu_attention(Q, K, V)              # grstack.kernels: SiLU(QK^T + rab) * mask / N, then ·V
    X'         = X + W2 · dropout(LN(A) ⊙ U)

Heads: retrieval (every history token's output, L2-normalised, scores the next item) and ranking
(M candidate tokens appended after the history attend to the history and themselves; an MLP gives one
logit per task).

Relay inference (serving): attention divides by a constant ``N``, so the per-layer keys and values of a
sequence's first ``P`` tokens do not depend on what follows. :meth:`HSTU.prefill_kv` computes them (what a
prefix cache stores, in the layout the attention backend wants: :func:`grstack.kernels.prefix_layout`);
:meth:`HSTU.encode_with_prefix` runs only new tokens (short-term history, candidates) at positions
``P, P + 1, ...`` against them, equal to :meth:`HSTU.encode`'s rows for those tokens on the whole sequence.

Time bias query (``time_bias_query``): ``self`` buckets ``|ts_i - ts_j|``; ``next`` buckets
``ts_next(i) - ts_j`` where ``ts_next(i)`` is the time of the event after token i (the moment its output
predicts, known at serving time: Meta's HSTU). With ``next`` the last prefix token's outputs at layers >= 2
depend on the time of the event after it, unknown when the prefix is cached, and the cache does not keep the
prefix's item ids to recompute that token, so such a model cannot be served from cached prefixes
(:meth:`HSTU.encode_with_prefix` refuses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from grstack import kernels
from grstack.runtime.data import JaggedBatch
from grstack.runtime.model.item_rows import ITEM_INIT_STD
from grstack.runtime.model.side_features import ItemFeatureMap, ItemTokens


def action_input_bits(action_inputs: bool, num_tasks: int) -> int:
    """Action bits a model with ``action_inputs`` embeds: the dataset's, one per ranking task after "next"."""
    if not action_inputs:
        return 0
    if num_tasks < 2:
        raise ValueError("model.action_inputs needs a dataset with actions (click, like, ...): this one has none")
    return num_tasks - 1


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
                num_targets: torch.Tensor | None, plan: kernels.JaggedPlan | None,
                query_timestamps: torch.Tensor | None = None) -> torch.Tensor:
        u, v, q, k = self.project(x)
        attn = kernels.hstu_attention(
            q, k, v, offsets, max_seq_len=self.max_seq_len, timestamps=timestamps,
            pos_weight=self.pos_weight, time_weight=self.time_weight, num_targets=num_targets, plan=plan,
            query_timestamps=query_timestamps)
        return self.finish(x, attn, u)

    def forward_with_prefix(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None,
                            num_targets: torch.Tensor | None, k_prefix: Sequence[torch.Tensor],
                            v_prefix: Sequence[torch.Tensor], prefix_timestamps: Sequence[torch.Tensor] | None,
                            plan: kernels.PrefixPlan, backend: str | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer on new tokens after cached prefixes (per sequence K/V of this layer); returns the output
        and the new tokens' K [n, H, dqk] and V [n, H, dv]."""
        u, v, q, k = self.project(x)
        attn = kernels.hstu_attention_with_prefix(
            q, k, v, offsets, k_prefix, v_prefix, max_seq_len=self.max_seq_len, timestamps=timestamps,
            prefix_timestamps=prefix_timestamps, pos_weight=self.pos_weight, time_weight=self.time_weight,
            num_targets=num_targets, plan=plan, backend=backend)
        return self.finish(x, attn, u), k, v


def next_event_timestamps(timestamps: torch.Tensor, offsets: torch.Tensor,
                          num_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Query times of the ``next`` time-bias convention, [sum_L] like ``timestamps``.

    A history token's query time is the next token's timestamp (the event its output predicts); the last
    history token's is the first candidate's when the sequence has candidates (the last ``num_targets[b]``
    tokens), else its own; candidates keep their own. Meta's HSTU extends timestamps the same way
    (``cat(ts[1:], ts[-1:])`` per sequence). Computed on the tensors' device without a host sync.
    """
    n = timestamps.numel()
    if n == 0:
        return timestamps
    seg = kernels.segment_ids(offsets, n)
    pos = kernels.positions(offsets, n)
    lengths = offsets[1:] - offsets[:-1]
    hist = lengths if num_targets is None else lengths - num_targets
    has_next = (pos + 1 < lengths[seg]) & (pos < hist[seg])
    return torch.where(has_next, torch.cat([timestamps[1:], timestamps[-1:]]), timestamps)


class HSTU(ItemTokens):
    """Retrieval + ranking HSTU over jagged sequences of item ids (and, with ``item_features``, their side
    features pooled into the item tokens: model/side_features.py)."""

    def __init__(self, num_items: int, *, max_len: int, d_model: int = 64, num_blocks: int = 4,
                 num_heads: int = 4, dqk: int = 16, dv: int = 16, dropout: float = 0.5,
                 input_dropout: float = 0.5, time_buckets: int = 128, position_bias: bool = True,
                 time_bias: bool = True, num_tasks: int = 1, ranking_head: bool = True,
                 item_table: bool = True, time_bias_query: str = "self",
                 item_features: ItemFeatureMap | None = None, user_features: dict[str, int] | None = None,
                 action_inputs: bool = False) -> None:
        super().__init__()
        if time_bias_query not in ("self", "next"):
            raise ValueError(f"time_bias_query must be self or next, not {time_bias_query!r}")
        if time_bias_query == "next" and user_features:
            raise ValueError("time_bias_query=next does not combine with user context tokens")
        self.time_bias_query = time_bias_query
        self.num_items, self.max_len, self.d_model = num_items, max_len, d_model
        # Candidates sit at position hist_len <= max_len, hence max_len + 1 positions; contextual tokens
        # (one per user field) head the sequence.
        self.max_seq_len = max_len + 1 + len(user_features or {})
        self._init_item_table(num_items, d_model, item_table, item_features, user_features,
                              action_bits=action_input_bits(action_inputs, num_tasks))
        self.pos_emb = nn.Embedding(self.max_seq_len, d_model)
        self.input_dropout = input_dropout
        self.layers = nn.ModuleList(
            HSTULayer(d_model, num_heads, dqk, dv, dropout, self.max_seq_len, time_buckets, position_bias,
                      time_bias)
            for _ in range(num_blocks))
        self.num_tasks = num_tasks
        self.rank_head = (nn.Sequential(nn.Linear(2 * d_model, d_model), nn.SiLU(), nn.Linear(d_model, num_tasks))
                          if ranking_head else None)
        if item_table:
            nn.init.trunc_normal_(self.item_emb.weight, std=ITEM_INIT_STD)
        nn.init.trunc_normal_(self.pos_emb.weight, std=d_model**-0.5)

    def token_positions(self, batch: JaggedBatch) -> torch.Tensor:
        """Positions 0, 1, ... per sequence; its last ``num_targets`` tokens (candidates) all sit at the
        position after its history."""
        n = batch.item_ids.numel()  # known on the host: no read-back of the offsets
        pos = kernels.positions(batch.offsets, n)
        if batch.num_targets is not None:
            hist = (batch.lengths - batch.num_targets)[kernels.segment_ids(batch.offsets, n)]
            pos = torch.minimum(pos, hist)
        return pos.clamp(max=self.max_seq_len - 1)

    def _prefix_positions(self, plan: kernels.PrefixPlan, num_targets: torch.Tensor | None,
                          device: torch.device) -> torch.Tensor:
        """:meth:`token_positions` of new tokens after cached prefixes (sequence b's start at its prefix
        length), computed on the host from the plan (a few small tensors, no per-token kernels). A prefix
        starts with the contextual tokens when the model reads user context; they take no position (as in
        :meth:`embed_batch`), so events count from after them."""
        nts = num_targets.tolist() if num_targets is not None else [0] * plan.batch_size
        head = self.context.num_fields if self.context is not None else 0
        parts = []
        for b, p in enumerate(plan.prefix_lengths):
            n = plan.offsets[b + 1] - plan.offsets[b]
            parts.append(np.minimum(np.arange(p, p + n), p + n - int(nts[b])) - head)
        pos = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return torch.as_tensor(np.clip(pos, 0, self.max_seq_len - 1), dtype=torch.int64).to(device)

    def _place_context(self, x: torch.Tensor, plan: kernels.PrefixPlan,
                       contexts: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
        """``x`` with the new tokens that are contextual tokens (a sequence's first ``C`` tokens: those after a
        prefix shorter than ``C``) replaced by the user's context vectors, as :meth:`embed_batch` heads a
        sequence with them (``contexts[b]``: sequence b's [C, W] value ids)."""
        head = self.context.num_fields if self.context is not None else 0
        idx, vecs = [], []
        for b, p in enumerate(plan.prefix_lengths):
            if p >= head:
                continue
            k = min(head - p, plan.offsets[b + 1] - plan.offsets[b])
            ctx = contexts[b] if contexts is not None else None
            if ctx is None:
                raise ValueError("the model reads user context: a prefix starts with the user's contextual "
                                 "tokens, and no context was given")
            rows = self.context_rows(ctx[None].to(x.device))[0] * math.sqrt(self.d_model)
            idx.append(torch.arange(plan.offsets[b], plan.offsets[b] + k, device=x.device))
            vecs.append(rows[p:p + k])
        if not idx:
            return x
        x = x.clone()
        x[torch.cat(idx)] = torch.cat(vecs).to(x.dtype)
        return x

    def _embed(self, item_rows: torch.Tensor, pos: torch.Tensor, actions: torch.Tensor | None = None) -> torch.Tensor:
        x = item_rows * math.sqrt(self.d_model) + self.pos_emb(pos)
        if actions is not None:
            x = x + actions
        return F.dropout(x, self.input_dropout, self.training)

    def embed_tokens(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``item_rows`` ([sum_L, d], optional): the tokens' rows as :meth:`token_rows` gives them, from rows
        looked up elsewhere (the sharded embedding of distributed training); else read from ``item_emb``."""
        if item_rows is None:
            item_rows = self.token_rows(batch.item_ids)
        actions = self.action_vectors(batch.input_actions)
        return self._embed(item_rows, self.token_positions(batch), actions)

    def embed_batch(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None,
                    context_rows: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The layers' input: (x, offsets, timestamps, index of the batch's own tokens or None), with the
        contextual tokens at the head of every sequence when the model reads user context (``context_rows``:
        :meth:`context_rows` computed elsewhere)."""
        x = self.embed_tokens(batch, item_rows)
        if self.context is None:
            return x, batch.offsets, batch.timestamps, None
        if context_rows is None:
            if batch.context is None:
                raise ValueError("the model reads user context: the batch has none")
            context_rows = self.context_rows(batch.context)
        ctx = F.dropout(context_rows * math.sqrt(self.d_model), self.input_dropout, self.training)
        return self.with_context(x, batch.offsets, batch.timestamps, ctx)

    def _uses_time(self) -> bool:
        return any(layer.time_weight is not None for layer in self.layers)

    def encode(self, batch: JaggedBatch, item_rows: torch.Tensor | None = None,
               context_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[sum_L, d] outputs for every token (history and candidates; contextual tokens are dropped)."""
        x, offsets, ts, keep = self.embed_batch(batch, item_rows, context_rows)
        plan = (kernels.make_plan(offsets, lengths=batch.host_lengths_with_context(self.num_context))
                if kernels.uses_plan(offsets.device) else None)
        ts = ts if self._uses_time() else None
        qts = None
        if ts is not None and self.time_bias_query == "next":
            qts = next_event_timestamps(ts, offsets, batch.num_targets)
        for layer in self.layers:
            x = layer(x, offsets, ts, batch.num_targets, plan, qts)
        return x if keep is None else x[keep]

    # -- relay inference: cached prefixes -----------------------------------------------------------
    @property
    def cached_prefix_exact(self) -> bool:
        """Whether a prefix's cached K/V are exact: a token's K/V must not depend on what follows it, which the
        ``next`` time bias breaks (module docstring)."""
        return not (self.time_bias_query == "next" and self._uses_time())

    def _check_prefix_servable(self) -> None:
        if not self.cached_prefix_exact:
            raise ValueError("a model with model.time_bias_query=next cannot run on cached prefixes (the last "
                             "prefix token's keys and values depend on the next event's time, and the cache "
                             "does not keep its item id to recompute it); train with model.time_bias_query=self "
                             "to serve from a prefix cache")

    def prefix_layout(self, backend: str | None = None) -> kernels.PrefixLayout:
        """How :meth:`prefill_kv` returns and :meth:`encode_with_prefix` takes one layer's keys/values of one
        sequence, for this model's device and the attention ``backend`` (None: the kernels' default)."""
        return kernels.prefix_layout(self.item_emb.weight.device, backend)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of the cached keys and values of one prefix token, over all layers."""
        return sum(layer.num_heads * (layer.dqk + layer.dv) for layer in self.layers)

    def empty_prefix_kv(self, backend: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer keys and values of an empty prefix."""
        layout = self.prefix_layout(backend)
        w = self.item_emb.weight
        keys = [layout.empty(layer.num_heads, layer.dqk, device=w.device, dtype=w.dtype) for layer in self.layers]
        values = [layout.empty(layer.num_heads, layer.dv, device=w.device, dtype=w.dtype) for layer in self.layers]
        return keys, values

    def encode_with_prefix(self, item_ids: torch.Tensor, timestamps: torch.Tensor, offsets: torch.Tensor,
                           prefix_keys: Sequence[Sequence[torch.Tensor]],
                           prefix_values: Sequence[Sequence[torch.Tensor]],
                           prefix_timestamps: Sequence[torch.Tensor], *, num_targets: torch.Tensor | None = None,
                           return_kv: bool = False, backend: str | None = None,
                           kv_out: tuple[Sequence[Sequence[torch.Tensor] | None],
                                         Sequence[Sequence[torch.Tensor] | None]] | None = None,
                           actions: torch.Tensor | None = None,
                           contexts: Sequence[torch.Tensor | None] | None = None,
                           ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Outputs [sum_S, d] of new tokens that follow cached prefixes.

        Sequence b's new tokens are ``item_ids[offsets[b]:offsets[b+1]]`` (S_b of them, timestamps alike).
        Its cached prefix has ``P_b`` tokens: per-layer keys ``prefix_keys[b][l]`` and values
        ``prefix_values[b][l]`` (in :meth:`prefix_layout`), timestamps ``prefix_timestamps[b]`` [P_b]. The new
        tokens start at position ``P_b``; the last ``num_targets[b]`` of them are candidates, which all sit at
        position ``P_b + S_b - num_targets[b]`` and see the history and themselves only. In eval mode the
        result equals :meth:`encode`'s rows for these tokens on the whole sequences.

        With ``return_kv``, also the new tokens' per-layer keys and values in :meth:`prefix_layout` (tokens of
        all sequences in order), else two empty lists. ``kv_out`` (keys, values), indexed ``[b][layer]``: tensors
        in :meth:`prefix_layout` of ``S_b`` tokens (e.g. views of a KV arena) the new tokens' keys and values are
        written into (None for a sequence: not written) — no intermediate tensors, no concatenation by the caller.

        A model with action inputs reads ``actions`` [sum_S] (each new token's own action bits; -1 for
        candidates: the "to be predicted" vector). A model with user context keeps the ``C`` contextual tokens
        at the head of every prefix: a sequence whose prefix is shorter than ``C`` starts with (the rest of)
        them, item id 0 in ``item_ids``, their vectors from ``contexts[b]`` ([C, W] value ids) and their time
        the first event's (:class:`grstack.runtime.serve.engine.PrefixTokens` builds such streams).
        """
        self._check_prefix_servable()
        layout = self.prefix_layout(backend)
        plens = [layout.length(keys[0]) for keys in prefix_keys]
        plan = kernels.make_prefix_plan(offsets, plens)
        rows = self.token_rows(item_ids)
        acts = self.action_vectors(actions) if self.action_emb is not None else None
        x = self._embed(rows, self._prefix_positions(plan, num_targets, item_ids.device), acts)
        if self.context is not None:
            x = self._place_context(x, plan, contexts)
        use_time = self._uses_time()
        ts = timestamps if use_time else None
        pts = list(prefix_timestamps) if use_time else None
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for li, layer in enumerate(self.layers):
            x, k, v = layer.forward_with_prefix(x, offsets, ts, num_targets, [p[li] for p in prefix_keys],
                                                [p[li] for p in prefix_values], pts, plan, backend)
            if kv_out is not None:
                for b in range(plan.batch_size):
                    if kv_out[0][b] is not None:
                        n0, n1 = plan.offsets[b], plan.offsets[b + 1]
                        layout.to_tokens(kv_out[0][b][li]).copy_(k[n0:n1])
                        layout.to_tokens(kv_out[1][b][li]).copy_(v[n0:n1])
            if return_kv:
                new_k.append(layout.from_tokens(k))
                new_v.append(layout.from_tokens(v))
        return x, new_k, new_v

    def prefill_kv(self, item_ids: torch.Tensor, timestamps: torch.Tensor, keys: Sequence[torch.Tensor] | None = None,
                   values: Sequence[torch.Tensor] | None = None, prefix_timestamps: torch.Tensor | None = None,
                   *, backend: str | None = None,
                   out: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
                   actions: torch.Tensor | None = None, context: torch.Tensor | None = None,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer keys and values of one sequence's prefix — what a relay cache stores, in
        :meth:`prefix_layout` — extended by the tokens ``item_ids`` (with ``timestamps``).

        ``keys``/``values``/``prefix_timestamps``: the prefix computed so far (None: empty), so a long prefix
        can be prefilled in chunks; the result does not depend on the chunking.

        ``out`` (keys, values): per-layer destinations of ``P + n`` tokens (``P`` the prefix's length, ``n``
        the new tokens'; e.g. views of a KV arena reserved for the whole prefix, whose first ``P`` tokens are
        the prefix): the new K/V are written into their last ``n`` tokens in place and ``out`` is returned, so
        a chunked prefill copies nothing (without it each chunk concatenates, O(P^2 / chunk) copies).

        ``actions``/``context``: the new tokens' action bits and the user's [C, W] context, for a model that
        reads them (:meth:`encode_with_prefix`).
        """
        layout = self.prefix_layout(backend)
        if keys is None or values is None:
            keys, values = self.empty_prefix_kv(backend)
            prefix_timestamps = timestamps.new_zeros(0)
        p, n = layout.length(keys[0]), item_ids.numel()
        if out is not None and any(layout.length(t) != p + n for t in (*out[0], *out[1])):
            raise ValueError(f"out must hold {p + n} tokens per layer (the prefix and the new tokens)")
        if n == 0:
            return (list(out[0]), list(out[1])) if out is not None else (list(keys), list(values))
        offsets = torch.tensor([0, n], dtype=torch.int64, device=item_ids.device)
        dest = None
        if out is not None:
            tail = lambda ts: [t.narrow(layout.seq_dim, p, n) for t in ts]  # noqa: E731
            dest = ([tail(out[0])], [tail(out[1])])
        _, new_k, new_v = self.encode_with_prefix(item_ids, timestamps, offsets, [keys], [values],
                                                  [prefix_timestamps], return_kv=dest is None, backend=backend,
                                                  kv_out=dest, actions=actions, contexts=[context])
        if out is not None:
            return list(out[0]), list(out[1])
        return ([layout.cat([a, b]) for a, b in zip(keys, new_k, strict=True)],
                [layout.cat([a, b]) for a, b in zip(values, new_v, strict=True)])

    def item_vectors(self, ids: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalised item vectors the retrieval head scores against (all items when ids is None);
        ``rows`` are already looked-up embedding rows to normalise instead, row by row (the trainer normalises
        each unique row once and gathers the copies after)."""
        if rows is not None:
            return F.normalize(rows, dim=-1)
        w = self.item_table_weight() if ids is None else kernels.embedding_gather(self.item_emb.weight, ids)
        return F.normalize(w, dim=-1)

    def query_vectors(self, outputs: torch.Tensor) -> torch.Tensor:
        return F.normalize(outputs, dim=-1)

    def keep_tasks(self, keep: Sequence[int]) -> None:
        """Keeps only the ranking head's outputs ``keep``, in that order: a head trained on logged exposures
        (``loss.ranking_on=exposures``) serves its action tasks, not its untrained "next" output."""
        if self.rank_head is None:
            raise RuntimeError("this model was built without a ranking head")
        keep = list(keep)
        last = self.rank_head[-1]
        head = nn.Linear(last.in_features, len(keep)).to(last.weight.device, last.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(last.weight[keep])
            head.bias.copy_(last.bias[keep])
        self.rank_head[-1] = head
        self.num_tasks = len(keep)

    def rank_logits(self, cand_outputs: torch.Tensor, cand_ids: torch.Tensor,
                    cand_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[M, num_tasks] logits from candidate-token outputs and the candidates' token rows (item row and
        pooled side features; ``cand_rows``: those rows computed elsewhere, as :meth:`token_rows`)."""
        if self.rank_head is None:
            raise RuntimeError("this model was built without a ranking head")
        rows = cand_rows if cand_rows is not None else self.token_rows(cand_ids)
        feats = torch.cat([cand_outputs, rows], dim=-1)
        return self.rank_head(feats)

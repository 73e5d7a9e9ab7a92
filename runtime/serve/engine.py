"""Relay inference on an HSTU ranking model: prefix K/V, chunked prefill, cached and full ranking.

HSTU attention divides by a constant ``N`` (DESIGN §3), so the per-layer keys and values of a user's first
``P`` tokens do not depend on anything appended after them. Prefill computes those K/V once (in chunks of
``chunk`` tokens, each chunk attending to the K/V already computed, so long prefills can be interleaved
with latency-critical work); ranking then runs only the short-term tokens and the candidates through the
layers, attending to the cached prefix (:func:`grstack.kernels.hstu_attention_with_prefix`).

Token layout of one ranking request, identical for the cached and the full path::

    long-term (kept: the last ``max_len - max_suffix``)  | short-term (kept: the last ``max_suffix``) | M candidates
    positions 0 .. P-1                                   | P .. P+S-1                                 | all at P+S

so ``P + S <= max_len`` and nothing is ever clamped: cached and full inference see the same sequence.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from grstack import kernels
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.jagged import JaggedBatch, lengths_to_offsets
from grstack.runtime.serve import attention as serve_attention
from grstack.runtime.serve.prefix import prefix_hash, truncate_prefix

__all__ = ["PrefixKV", "RankItem", "RelayEngine", "prefix_hash"]


@dataclass
class PrefixKV:
    """Per-layer keys [P, H, dqk] and values [P, H, dv] of a prefix, with its timestamps [P]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    timestamps: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.timestamps.numel())

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, self.timestamps]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def device(self) -> torch.device:
        return self.timestamps.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixKV:
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return PrefixKV([move(k) for k in self.keys], [move(v) for v in self.values], move(self.timestamps))

    def pin_memory(self) -> PrefixKV:
        return PrefixKV([k.pin_memory() for k in self.keys], [v.pin_memory() for v in self.values],
                        self.timestamps.pin_memory())


@dataclass
class RankItem:
    """One ranking request in canonical (already truncated) form; arrays are int64."""

    long_items: np.ndarray
    long_ts: np.ndarray
    short_items: np.ndarray
    short_ts: np.ndarray
    candidates: np.ndarray
    request_ts: int


class RelayEngine:
    """Stateless compute on one device; the caller owns caching and scheduling."""

    def __init__(self, model: nn.Module, *, device: torch.device | str = "cpu", max_suffix: int = 64,
                 chunk: int = 256, attention: str | None = None) -> None:
        if getattr(model, "rank_head", None) is None or not hasattr(model, "layers"):
            raise ValueError("relay serving needs an HSTU model with a ranking head")
        if not 0 < max_suffix < model.max_len:
            raise ValueError(f"max_suffix must be in 1..{model.max_len - 1} (the model's max_len is "
                             f"{model.max_len})")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.max_len = int(model.max_len)
        self.max_suffix = int(max_suffix)
        self.max_prefix = self.max_len - self.max_suffix
        self.chunk = int(chunk)
        # "serve": the CPU-arranged path of this package ([H, P, d] cache layout); "kernels": the kernels'
        # dispatcher (fused Triton on CUDA; [P, H, d] layout). Both compute the reference math.
        self.attention = attention or ("serve" if self.device.type == "cpu" else "kernels")
        if self.attention not in ("serve", "kernels"):
            raise ValueError(f"attention must be 'serve' or 'kernels', not {self.attention!r}")
        self._seq_dim = 1 if self.attention == "serve" else 0
        self.use_time = any(layer.time_weight is not None for layer in model.layers)
        first = model.layers[0]
        self.kv_bytes_per_token = len(model.layers) * first.num_heads * (first.dqk + first.dv) * 4 + 8

    # -- request canonicalisation -------------------------------------------------------------------
    def canonical(self, long_items: Sequence[int], long_ts: Sequence[int], short_items: Sequence[int],
                  short_ts: Sequence[int], candidates: Sequence[int], request_ts: int) -> RankItem:
        """Applies the serving truncation (the same for the cached and the full path)."""
        li, lt = truncate_prefix(long_items, long_ts, self.max_prefix)
        si, st = truncate_prefix(short_items, short_ts, self.max_suffix)
        return RankItem(li, lt, si, st, np.asarray(candidates, dtype=np.int64), int(request_ts))

    def truncate_prefix(self, items: Sequence[int], ts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        return truncate_prefix(items, ts, self.max_prefix)

    # -- building blocks ----------------------------------------------------------------------------
    def _tensor(self, xs: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(xs, dtype=np.int64), device=self.device)

    def _embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # HSTU.embed_tokens in eval mode, with explicit positions (the prefix is not part of this batch).
        m = self.model
        emb = kernels.embedding_gather(m.item_emb.weight, ids)
        return emb * math.sqrt(m.d_model) + m.pos_emb(pos.clamp(max=m.max_seq_len - 1))

    def _forward_new(self, prefixes: list[PrefixKV], ids: torch.Tensor, ts: torch.Tensor, offsets: list[int],
                     pos: torch.Tensor, num_targets: list[int],
                     keep_kv: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Runs new tokens (rows ``offsets[b]:offsets[b+1]`` per sequence) through every layer, attending to
        the cached prefixes; returns the outputs and, with ``keep_kv``, the new tokens' per-layer K/V."""
        m = self.model
        x = self._embed(ids, pos)
        first = m.layers[0]
        plan = None
        if self.attention == "serve":
            plan = serve_attention.make_plan(
                offsets, [p.length for p in prefixes], num_targets, ts if self.use_time else None,
                [p.timestamps for p in prefixes] if self.use_time else None, max_seq_len=first.max_seq_len,
                num_pos=first.pos_weight.numel() if first.pos_weight is not None else None,
                num_time_buckets=first.time_weight.numel() - 1 if first.time_weight is not None else None)
        else:
            offsets_t = torch.tensor(offsets, dtype=torch.int64, device=self.device)
            plens = torch.tensor([p.length for p in prefixes], dtype=torch.int64)
            poffsets = lengths_to_offsets(plens).to(self.device)
            nt = torch.tensor(num_targets, dtype=torch.int64, device=self.device)
            pts = torch.cat([p.timestamps for p in prefixes])
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for li, layer in enumerate(m.layers):
            u, v, q, k = layer.project(x)
            if plan is not None:
                attn = serve_attention.prefix_attention(q, k, v, [p.keys[li] for p in prefixes],
                                                        [p.values[li] for p in prefixes], plan,
                                                        layer.pos_weight, layer.time_weight)
            else:
                kp = torch.cat([p.keys[li] for p in prefixes])
                vp = torch.cat([p.values[li] for p in prefixes])
                attn = kernels.hstu_attention_with_prefix(
                    q, k, v, offsets_t, kp, vp, poffsets, max_seq_len=layer.max_seq_len,
                    timestamps=ts if self.use_time else None, prefix_timestamps=pts if self.use_time else None,
                    pos_weight=layer.pos_weight, time_weight=layer.time_weight, num_targets=nt)
            if keep_kv:
                if self.attention == "serve":
                    k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
                new_k.append(k)
                new_v.append(v)
            x = layer.finish(x, attn, u)
        return x, new_k, new_v

    def empty_prefix(self) -> PrefixKV:
        layer = self.model.layers[0]
        h = layer.num_heads
        n = len(self.model.layers)
        shape = (lambda d: (h, 0, d)) if self.attention == "serve" else (lambda d: (0, h, d))
        zk = torch.zeros(*shape(layer.dqk), device=self.device)
        zv = torch.zeros(*shape(layer.dv), device=self.device)
        return PrefixKV([zk] * n, [zv] * n, torch.zeros(0, dtype=torch.int64, device=self.device))

    # -- prefill ------------------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, prefix: PrefixKV, items: np.ndarray, ts: np.ndarray) -> PrefixKV:
        """K/V of ``prefix`` followed by the tokens ``items`` (one chunk of a prefill)."""
        n = len(items)
        if n == 0:
            return prefix
        ids_t, ts_t = self._tensor(items), self._tensor(ts)
        pos = prefix.length + torch.arange(n, device=self.device)
        _, ks, vs = self._forward_new([prefix], ids_t, ts_t, [0, n], pos, [0], keep_kv=True)
        d = self._seq_dim
        return PrefixKV([torch.cat([a, b], dim=d) for a, b in zip(prefix.keys, ks, strict=True)],
                        [torch.cat([a, b], dim=d) for a, b in zip(prefix.values, vs, strict=True)],
                        torch.cat([prefix.timestamps, ts_t]))

    def prefill_steps(self, items: np.ndarray, ts: np.ndarray) -> Iterator[PrefixKV]:
        """Yields the growing prefix after each chunk; the last value is the whole prefix's K/V."""
        prefix = self.empty_prefix()
        if len(items) == 0:
            yield prefix
            return
        for start in range(0, len(items), self.chunk):
            prefix = self.extend(prefix, items[start:start + self.chunk], ts[start:start + self.chunk])
            yield prefix

    def prefill(self, items: np.ndarray, ts: np.ndarray) -> PrefixKV:
        prefix = self.empty_prefix()
        for prefix in self.prefill_steps(items, ts):  # noqa: B007
            pass
        return prefix

    # -- ranking ------------------------------------------------------------------------------------
    @torch.no_grad()
    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        """[M_b, num_tasks] logits per request, from its cached prefix plus short-term and candidates."""
        if not reqs:
            return []
        ids, tss, pos, lens, nts = [], [], [], [], []
        for p, r in zip(prefixes, reqs, strict=True):
            s, mc = len(r.short_items), len(r.candidates)
            ids += [r.short_items, r.candidates]
            tss += [r.short_ts, np.full(mc, r.request_ts, dtype=np.int64)]
            pos += [p.length + np.arange(s), np.full(mc, p.length + s)]
            lens.append(s + mc)
            nts.append(mc)
        ids_t = self._tensor(np.concatenate(ids))
        ts_t = self._tensor(np.concatenate(tss))
        pos_t = self._tensor(np.concatenate(pos))
        offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
        x, _, _ = self._forward_new(prefixes, ids_t, ts_t, offsets, pos_t, nts, keep_kv=False)
        cand_rows = self._tensor(np.concatenate([np.arange(offsets[b + 1] - n, offsets[b + 1])
                                                 for b, n in enumerate(nts)]))
        logits = self.model.rank_logits(x[cand_rows], ids_t[cand_rows]).float()
        return list(torch.split(logits, nts))

    def rank_full(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        """Full inference (no cache): the whole history is computed on the critical path.

        Long histories go through the chunked prefill (the same math, fewer attention elements than one
        dense causal block); short ones through :meth:`HSTU.encode`, which batches them jagged.
        """
        long_reqs = [i for i, r in enumerate(reqs) if len(r.long_items) > self.chunk]
        short_reqs = sorted(set(range(len(reqs))) - set(long_reqs))
        out: list[torch.Tensor | None] = [None] * len(reqs)
        if long_reqs:
            prefixes = [self.prefill(reqs[i].long_items, reqs[i].long_ts) for i in long_reqs]
            for i, logits in zip(long_reqs, self.rank_cached(prefixes, [reqs[i] for i in long_reqs]),
                                 strict=True):
                out[i] = logits
        if short_reqs:
            for i, logits in zip(short_reqs, self.rank_encode([reqs[i] for i in short_reqs]), strict=True):
                out[i] = logits
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def rank_encode(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        """The oracle: :meth:`HSTU.encode` over history + candidates, then the ranking head."""
        if not reqs:
            return []
        hist = [np.concatenate([r.long_items, r.short_items]) for r in reqs]
        hts = [np.concatenate([r.long_ts, r.short_ts]) for r in reqs]
        m_max = max(len(r.candidates) for r in reqs)
        if any(len(r.candidates) != m_max for r in reqs):
            return [t for r in reqs for t in self.rank_encode([r])]
        lengths = torch.tensor([len(h) for h in hist], dtype=torch.int64)
        batch = JaggedBatch(item_ids=self._tensor(np.concatenate(hist)),
                            offsets=lengths_to_offsets(lengths).to(self.device),
                            timestamps=self._tensor(np.concatenate(hts)))
        cands = self._tensor(np.stack([r.candidates for r in reqs]))
        cts = self._tensor([r.request_ts for r in reqs])
        full, is_hist = append_candidates(batch, cands, cts)
        x = self.model.encode(full)
        rows = ~is_hist
        logits = self.model.rank_logits(x[rows], full.item_ids[rows]).float()
        return list(torch.split(logits, [len(r.candidates) for r in reqs]))

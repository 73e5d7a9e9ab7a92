"""Relay inference on an HSTU ranking model: prefix K/V, chunked prefill, cached and full ranking.

HSTU attention divides by a constant ``N`` (docs/architecture.md §3), so the per-layer keys and values of a
user's first ``P`` tokens do not depend on anything appended after them. Prefill computes those K/V once (in chunks of
``chunk`` tokens, each chunk attending to the K/V already computed, so long prefills can be interleaved
with latency-critical work); ranking then runs only the short-term tokens and the candidates through the
layers, attending to the cached prefix. The model does the compute (:meth:`HSTU.prefill_kv`,
:meth:`HSTU.encode_with_prefix`, over :func:`grstack.kernels.hstu_attention_with_prefix`); this engine
canonicalises requests, batches them and keeps the K/V in the layout the kernels' backend wants
(head-major [H, P, d] on CPU, token-major [P, H, d] for Triton on CUDA). A prefix may live in a per-replica
KV arena (:mod:`grstack.runtime.serve.kv_arena`): then :meth:`RelayEngine.extend` writes each chunk into its
reserved range in place, and ranking passes views of the arena.

Token layout of one ranking request, identical for the cached and the full path::

    long-term (kept: the last ``max_len - max_suffix``)  | short-term (kept: the last ``max_suffix``) | M candidates
    positions 0 .. P-1                                   | P .. P+S-1                                 | all at P+S

so ``P + S <= max_len`` and nothing is ever clamped: cached and full inference see the same sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from grstack import kernels
from grstack.runtime.data import JaggedBatch, append_candidates
from grstack.runtime.serve.prefix import prefix_hash, truncate_prefix

__all__ = ["PrefixKV", "RankItem", "RelayEngine", "prefix_hash"]


@dataclass
class PrefixKV:
    """Per-layer keys and values of a prefix, with its timestamps [P]; each tensor in the layout of the
    engine's attention backend (``model.prefix_layout(engine.backend)``: [H, P, d] on CPU, [P, H, d] for
    Triton)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    timestamps: torch.Tensor
    ready: Any = None  # a torch.cuda.Event the tensors' contents wait on (a copy still running), or None

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
        if self.ready is not None:  # the copy that fills these tensors must finish before they are read
            target = torch.device(device)
            if target.type == "cuda":
                torch.cuda.current_stream(target).wait_event(self.ready)
            else:
                self.ready.synchronize()
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return PrefixKV([move(k) for k in self.keys], [move(v) for v in self.values], move(self.timestamps))

    def to_host_async(self, stream: Any) -> PrefixKV:
        """A copy in pinned host memory made on the CUDA side ``stream`` without blocking the caller (the event
        loop): the copy waits for the work that produced the tensors, the sources stay allocated until it has
        run (``record_stream``), and :meth:`to` waits for the result's ``ready`` event before reading it."""
        src = [*self.keys, *self.values, self.timestamps]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in src]
            ready = torch.cuda.Event()
            ready.record(stream)
        for t in src:
            t.record_stream(stream)
        n = len(self.keys)
        return PrefixKV(dst[:n], dst[n:2 * n], dst[-1], ready)

    def pin_memory(self) -> PrefixKV:
        return PrefixKV([k.pin_memory() for k in self.keys], [v.pin_memory() for v in self.values],
                        self.timestamps.pin_memory())

    # A prefix held in a KV arena (runtime/serve/kv_arena.py, ArenaKV) overrides these: room reserved after
    # it for in-place growth, and the hold/pin protocol of its arena range. Plain tensors need none of it.
    @property
    def room(self) -> int:
        """Tokens that can be appended in place (:meth:`RelayEngine.extend` writes them without a copy)."""
        return 0

    @property
    def live(self) -> bool:
        """False once the storage behind the views was freed (an arena range evicted and reused)."""
        return True

    def pin(self) -> bool:
        """Compute is about to read it: keep its storage alive and in place until :meth:`unpin`."""
        return True

    def unpin(self) -> None:
        pass

    def release(self) -> None:
        """The holder of a reserved prefix (a finished prefill's result) gives it up without caching it."""


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
                 chunk: int = 256, backend: str | None = None) -> None:
        if getattr(model, "rank_head", None) is None or not hasattr(model, "encode_with_prefix"):
            raise ValueError("relay serving needs an HSTU model with a ranking head")
        if not getattr(model, "cached_prefix_exact", True):
            raise ValueError("relay serving needs model.time_bias_query=self: with next, cached prefixes are not "
                             "exact (the last prefix token's keys and values depend on the next event's time)")
        if getattr(model, "context", None) is not None or getattr(model, "action_emb", None) is not None:
            raise ValueError("relay serving does not take user context or action inputs yet (requests carry "
                             "neither)")
        if not 0 < max_suffix < model.max_len:
            raise ValueError(f"max_suffix must be in 1..{model.max_len - 1} (the model's max_len is "
                             f"{model.max_len})")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.max_len = int(model.max_len)
        self.max_suffix = int(max_suffix)
        self.max_prefix = self.max_len - self.max_suffix
        self.chunk = int(chunk)
        # The kernels' backend for cached-prefix attention (None: by device — the torch prefix path on CPU,
        # fused Triton on CUDA), resolved once: it fixes the layout the cached K/V are kept in
        # (self.model.prefix_layout(self.backend)).
        self.backend = kernels.select_backend(self.device, backend)
        self.kv_bytes_per_token = model.kv_elements_per_token * 4 + 8  # fp32 K/V and an int64 timestamp

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

    def empty_prefix(self) -> PrefixKV:
        keys, values = self.model.empty_prefix_kv(self.backend)
        return PrefixKV(keys, values, torch.zeros(0, dtype=torch.int64, device=self.device))

    # -- prefill ------------------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, prefix: PrefixKV, items: np.ndarray, ts: np.ndarray) -> PrefixKV:
        """K/V of ``prefix`` followed by the tokens ``items`` (one chunk of a prefill): written in place when
        ``prefix`` has the room reserved (a KV arena range), else concatenated into new tensors."""
        n = len(items)
        if n == 0:
            return prefix
        ids_t, ts_t = self._tensor(items), self._tensor(ts)
        if prefix.room >= n:  # reserved in a KV arena: write the new K/V in place, no concatenation
            grown = prefix.grown(n)  # type: ignore[attr-defined]
            self.model.prefill_kv(ids_t, ts_t, prefix.keys, prefix.values, prefix.timestamps,
                                  backend=self.backend, out=(grown.keys, grown.values))
            grown.timestamps[prefix.length:].copy_(ts_t)
            return grown
        keys, values = self.model.prefill_kv(ids_t, ts_t, prefix.keys, prefix.values, prefix.timestamps,
                                             backend=self.backend)
        return PrefixKV(keys, values, torch.cat([prefix.timestamps, ts_t]))

    @torch.no_grad()
    def extend_many(self, prefixes: Sequence[PrefixKV], items: Sequence[np.ndarray],
                    ts: Sequence[np.ndarray]) -> list[PrefixKV]:
        """:meth:`extend` of several users' prefixes at once: one model call jagged over the sequences. A
        prefix with room reserved in a KV arena gets its new K/V written in place; the others' come back from
        the model in order and are split and concatenated per sequence here. A single non-empty sequence goes
        through :meth:`extend` itself."""
        out = list(prefixes)
        live = [b for b in range(len(prefixes)) if len(items[b])]
        if len(live) == 1:
            b = live[0]
            out[b] = self.extend(prefixes[b], items[b], ts[b])
        if len(live) <= 1:
            return out
        lens = [len(items[b]) for b in live]
        ids_t = self._tensor(np.concatenate([items[b] for b in live]))
        ts_t = self._tensor(np.concatenate([ts[b] for b in live]))
        offsets = self._tensor(np.concatenate([[0], np.cumsum(lens)]))
        # Sequences with room reserved in a KV arena get their new K/V written in place; the others' come back
        # from the model and are concatenated onto their prefix.
        layout = self.model.prefix_layout(self.backend)
        grown = {b: prefixes[b].grown(n) for b, n in zip(live, lens, strict=True)  # type: ignore[attr-defined]
                 if prefixes[b].room >= n}

        def tail(tensors: list[torch.Tensor], b: int) -> list[torch.Tensor]:
            return [t.narrow(layout.seq_dim, prefixes[b].length, len(items[b])) for t in tensors]

        dest = None
        if grown:
            dest = ([tail(grown[b].keys, b) if b in grown else None for b in live],
                    [tail(grown[b].values, b) if b in grown else None for b in live])
        _, new_k, new_v = self.model.encode_with_prefix(
            ids_t, ts_t, offsets, [prefixes[b].keys for b in live], [prefixes[b].values for b in live],
            [prefixes[b].timestamps for b in live], return_kv=len(grown) < len(live), backend=self.backend,
            kv_out=dest)
        split_ts = torch.split(ts_t, lens)
        split_k = [torch.split(k, lens, dim=layout.seq_dim) for k in new_k]
        split_v = [torch.split(v, lens, dim=layout.seq_dim) for v in new_v]
        for j, b in enumerate(live):
            p = prefixes[b]
            if b in grown:
                grown[b].timestamps[p.length:].copy_(split_ts[j])
                out[b] = grown[b]
                continue
            out[b] = PrefixKV([layout.cat([k, parts[j]]) for k, parts in zip(p.keys, split_k, strict=True)],
                              [layout.cat([v, parts[j]]) for v, parts in zip(p.values, split_v, strict=True)],
                              torch.cat([p.timestamps, split_ts[j]]))
        return out

    def prefill_steps(self, items: np.ndarray, ts: np.ndarray, into: PrefixKV | None = None) -> Iterator[PrefixKV]:
        """Yields the growing prefix after each chunk; the last value is the whole prefix's K/V. ``into``: an
        empty prefix with room reserved (a KV arena block) that the chunks are written into in place."""
        prefix = self.empty_prefix() if into is None else into
        if len(items) == 0:
            yield prefix
            return
        for start in range(0, len(items), self.chunk):
            prefix = self.extend(prefix, items[start:start + self.chunk], ts[start:start + self.chunk])
            yield prefix

    def prefill(self, items: np.ndarray, ts: np.ndarray, into: PrefixKV | None = None) -> PrefixKV:
        prefix = self.empty_prefix()
        for prefix in self.prefill_steps(items, ts, into):  # noqa: B007
            pass
        return prefix

    # -- ranking ------------------------------------------------------------------------------------
    @torch.no_grad()
    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        """[M_b, num_tasks] logits per request, from its cached prefix plus short-term and candidates."""
        if not reqs:
            return []
        ids, tss, lens, nts = [], [], [], []
        for r in reqs:
            s, mc = len(r.short_items), len(r.candidates)
            ids += [r.short_items, r.candidates]
            tss += [r.short_ts, np.full(mc, r.request_ts, dtype=np.int64)]
            lens.append(s + mc)
            nts.append(mc)
        ids_t = self._tensor(np.concatenate(ids))
        ts_t = self._tensor(np.concatenate(tss))
        offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
        x, _, _ = self.model.encode_with_prefix(
            ids_t, ts_t, self._tensor(offsets), [p.keys for p in prefixes], [p.values for p in prefixes],
            [p.timestamps for p in prefixes], num_targets=self._tensor(nts), backend=self.backend)
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
                            offsets=kernels.lengths_to_offsets(lengths).to(self.device),
                            timestamps=self._tensor(np.concatenate(hts)))
        cands = self._tensor(np.stack([r.candidates for r in reqs]))
        cts = self._tensor([r.request_ts for r in reqs])
        full, is_hist = append_candidates(batch, cands, cts)
        x = self.model.encode(full)
        rows = ~is_hist
        logits = self.model.rank_logits(x[rows], full.item_ids[rows]).float()
        return list(torch.split(logits, [len(r.candidates) for r in reqs]))

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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from grstack import kernels
from grstack.runtime.data import JaggedBatch, append_candidates
from grstack.runtime.serve.prefix import prefix_hash, truncate_prefix

if TYPE_CHECKING:
    from grstack.runtime.model import HSTU

__all__ = ["KV_DTYPES", "PrefixKV", "PrefixTokens", "RankItem", "RelayEngine", "prefix_hash", "resolve_kv_dtype"]

# Item ids, timestamps or action bits of events: a request's lists or arrays.
Ints = Sequence[int] | np.ndarray


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
    long_actions: np.ndarray | None = None  # each event's action bits, when the model reads them
    short_actions: np.ndarray | None = None
    context: np.ndarray | None = None  # [C, W] the user's feature value ids (0: none), when the model reads them


@dataclass
class PrefixTokens:
    """What a prefix's K/V are computed from, token by token: the model's ``head`` contextual tokens (item 0,
    the first event's time, no actions; their vectors come from ``context``), then the long-term events."""

    items: np.ndarray
    ts: np.ndarray
    actions: np.ndarray | None = None
    context: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.items)

    def slice(self, start: int, stop: int) -> PrefixTokens:
        acts = self.actions[start:stop] if self.actions is not None else None
        return PrefixTokens(self.items[start:stop], self.ts[start:stop], acts, self.context)


KV_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    """The torch dtype a ``kv_dtype`` setting names (None: ``default``, the model's)."""
    if kv_dtype is None:
        return default
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    try:
        return KV_DTYPES[kv_dtype.strip().lower()]
    except KeyError:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}") from None


class RelayEngine:
    """Stateless compute on one device; the caller owns caching and scheduling."""

    def __init__(self, model: HSTU, *, device: torch.device | str = "cpu", max_suffix: int = 64,
                 chunk: int = 256, backend: str | None = None, kv_dtype: str | torch.dtype | None = None) -> None:
        """``kv_dtype``: what cached K/V are kept in ("fp32"/"bf16"/"fp16" or a torch dtype; None: the model's
        own dtype, exact). A narrower dtype halves a prefix's bytes; compute still runs in the model's dtype
        (a cached prefix is widened at each call), so only the stored K/V are rounded."""
        if getattr(model, "rank_head", None) is None or not hasattr(model, "encode_with_prefix"):
            raise ValueError("relay serving needs an HSTU model with a ranking head")
        if not getattr(model, "cached_prefix_exact", True):
            raise ValueError("relay serving needs model.time_bias_query=self: with next, cached prefixes are not "
                             "exact (the last prefix token's keys and values depend on the next event's time)")
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
        self.compute_dtype: torch.dtype = self.model.item_emb.weight.dtype  # type: ignore[assignment]
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.compute_dtype)
        self.kv_element_size = torch.empty(0, dtype=self.kv_dtype).element_size()
        # K/V of every layer in the cache's dtype and an int64 timestamp
        self.kv_bytes_per_token = model.kv_elements_per_token * self.kv_element_size + 8
        # What the model reads besides items and times: each event's action bits (candidates get the "to be
        # predicted" vector), and the user's context as ``head`` tokens at the start of every prefix.
        action_emb = getattr(model, "action_emb", None)
        self.action_bits = int(action_emb.num_embeddings) - 1 if action_emb is not None else 0
        context = getattr(model, "context", None)
        self.head = int(context.num_fields) if context is not None else 0

    # -- request canonicalisation -------------------------------------------------------------------
    def canonical(self, long_items: Ints, long_ts: Ints, short_items: Ints,
                  short_ts: Ints, candidates: Ints, request_ts: int,
                  long_actions: Ints | None = None, short_actions: Ints | None = None,
                  context: np.ndarray | None = None) -> RankItem:
        """Applies the serving truncation (the same for the cached and the full path). Actions and context are
        kept only when the model reads them, and then must be given."""
        li, lt = truncate_prefix(long_items, long_ts, self.max_prefix)
        si, st = truncate_prefix(short_items, short_ts, self.max_suffix)
        la = self._actions(long_actions, len(long_items), self.max_prefix, "long_actions")
        sa = self._actions(short_actions, len(short_items), self.max_suffix, "short_actions")
        return RankItem(li, lt, si, st, np.asarray(candidates, dtype=np.int64), int(request_ts), la, sa,
                        self._context(context))

    def truncate_prefix(self, items: Ints, ts: Ints) -> tuple[np.ndarray, np.ndarray]:
        return truncate_prefix(items, ts, self.max_prefix)

    def truncate_actions(self, actions: Ints | None, n: int) -> np.ndarray | None:
        """The actions of :meth:`truncate_prefix`'s events (None when the model reads none)."""
        return self._actions(actions, n, self.max_prefix, "long_actions")

    def _actions(self, actions: Ints | None, n: int, keep: int, name: str) -> np.ndarray | None:
        if not self.action_bits:
            return None
        if actions is None:
            if n == 0:
                return np.zeros(0, dtype=np.int64)
            raise ValueError(f"{name}: the model reads each event's actions; none were given")
        a = np.asarray(actions, dtype=np.int64)
        if len(a) != n:
            raise ValueError(f"{name}: {len(a)} actions for {n} events")
        return a[-keep:] if keep > 0 else a[:0]

    def _context(self, context: np.ndarray | None) -> np.ndarray | None:
        return self._context_ids(context) if self.head else None

    def _context_ids(self, context: np.ndarray | None) -> np.ndarray:
        """A request's user context as the [fields, W] value ids of a model that reads it."""
        if context is None:
            return np.zeros((self.head, 1), dtype=np.int64)  # no values: the fields' tokens are zero vectors
        c = np.asarray(context, dtype=np.int64)
        if c.ndim != 2 or c.shape[0] != self.head:
            raise ValueError(f"context: expected [{self.head}, W] value ids, got shape {tuple(c.shape)}")
        return c

    def prefix_tokens(self, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
                      context: np.ndarray | None = None) -> PrefixTokens:
        """The token stream of the prefix of (already truncated) long-term events ``items``/``ts``: the model's
        contextual tokens first when it reads user context, timed at the first event as in training."""
        items = np.asarray(items, dtype=np.int64)
        ts = np.asarray(ts, dtype=np.int64)
        acts = None
        if self.action_bits:
            acts = np.asarray(actions if actions is not None else np.zeros(len(items)), dtype=np.int64)
        if not self.head or not len(items):
            return PrefixTokens(items, ts, acts, None)
        h = self.head
        first = np.full(h, ts[0], dtype=np.int64)
        return PrefixTokens(np.concatenate([np.zeros(h, dtype=np.int64), items]), np.concatenate([first, ts]),
                            np.concatenate([np.zeros(h, dtype=np.int64), acts]) if acts is not None else None,
                            self._context(context))

    def item_tokens(self, item: RankItem) -> PrefixTokens:
        return self.prefix_tokens(item.long_items, item.long_ts, item.long_actions, item.context)

    # -- building blocks ----------------------------------------------------------------------------
    def _tensor(self, xs: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(xs, dtype=np.int64), device=self.device)

    def empty_prefix(self) -> PrefixKV:
        keys, values = self.model.empty_prefix_kv(self.backend)
        return PrefixKV(self._stored(keys), self._stored(values), torch.zeros(0, dtype=torch.int64, device=self.device))

    def _stored(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors as the cache keeps them (its K/V dtype); no copy when already so."""
        return [t if t.dtype == self.kv_dtype else t.to(self.kv_dtype) for t in tensors]

    def _computed(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Cached K/V as the model computes with them (its dtype); no copy when the cache keeps that dtype."""
        return [t if t.dtype == self.compute_dtype else t.to(self.compute_dtype) for t in tensors]

    # -- prefill ------------------------------------------------------------------------------------
    def _model_inputs(self, actions: np.ndarray | None, context: np.ndarray | None,
                      n: int) -> dict[str, Any]:
        """The keyword inputs of the model's prefix calls for tokens of one sequence: their actions and the
        user's context, when the model reads them."""
        out: dict[str, Any] = {}
        if self.action_bits:
            out["actions"] = self._tensor(actions if actions is not None else np.zeros(n, dtype=np.int64))
        if self.head:
            out["context"] = self._tensor(context) if context is not None else None
        return out

    @torch.no_grad()
    def extend(self, prefix: PrefixKV, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
               context: np.ndarray | None = None) -> PrefixKV:
        """K/V of ``prefix`` followed by the tokens ``items`` (one chunk of a prefill; with their ``actions``
        and the user's ``context`` when the model reads them, as :class:`PrefixTokens` holds them): written in
        place when ``prefix`` has the room reserved (a KV arena range), else concatenated into new tensors."""
        n = len(items)
        if n == 0:
            return prefix
        ids_t, ts_t = self._tensor(items), self._tensor(ts)
        extra = self._model_inputs(actions, context, n)
        if prefix.room >= n:  # reserved in a KV arena: write the new K/V in place, no concatenation
            grown = prefix.grown(n)  # type: ignore[attr-defined]
            # attend over the prefix as the model computes (widened when the cache is narrower); the new
            # tokens' K/V are written (and rounded to the cache's dtype) into the reserved range in place
            self.model.prefill_kv(ids_t, ts_t, self._computed(prefix.keys), self._computed(prefix.values),
                                  prefix.timestamps, backend=self.backend, out=(grown.keys, grown.values), **extra)
            grown.timestamps[prefix.length:].copy_(ts_t)
            return grown
        keys, values = self.model.prefill_kv(ids_t, ts_t, self._computed(prefix.keys),
                                             self._computed(prefix.values), prefix.timestamps,
                                             backend=self.backend, **extra)
        return PrefixKV(self._stored(keys), self._stored(values), torch.cat([prefix.timestamps, ts_t]))

    @torch.no_grad()
    def extend_many(self, prefixes: Sequence[PrefixKV], items: Sequence[np.ndarray],
                    ts: Sequence[np.ndarray], actions: Sequence[np.ndarray | None] | None = None,
                    contexts: Sequence[np.ndarray | None] | None = None) -> list[PrefixKV]:
        """:meth:`extend` of several users' prefixes at once: one model call jagged over the sequences. A
        prefix with room reserved in a KV arena gets its new K/V written in place; the others' come back from
        the model in order and are split and concatenated per sequence here. A single non-empty sequence goes
        through :meth:`extend` itself."""
        out = list(prefixes)
        acts = list(actions) if actions is not None else [None] * len(prefixes)
        ctxs = list(contexts) if contexts is not None else [None] * len(prefixes)
        live = [b for b in range(len(prefixes)) if len(items[b])]
        if len(live) == 1:
            b = live[0]
            out[b] = self.extend(prefixes[b], items[b], ts[b], acts[b], ctxs[b])
        if len(live) <= 1:
            return out
        lens = [len(items[b]) for b in live]
        ids_t = self._tensor(np.concatenate([items[b] for b in live]))
        ts_t = self._tensor(np.concatenate([ts[b] for b in live]))
        offsets = self._tensor(np.concatenate([[0], np.cumsum(lens)]))
        extra: dict[str, Any] = {}
        if self.action_bits:
            extra["actions"] = self._tensor(np.concatenate(
                [acts[b] if acts[b] is not None else np.zeros(lens[j], dtype=np.int64) for j, b in enumerate(live)]))
        if self.head:
            extra["contexts"] = [self._tensor(c) if (c := ctxs[b]) is not None else None for b in live]
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
            ids_t, ts_t, offsets, [self._computed(prefixes[b].keys) for b in live],
            [self._computed(prefixes[b].values) for b in live],
            [prefixes[b].timestamps for b in live], return_kv=len(grown) < len(live), backend=self.backend,
            kv_out=dest, **extra)
        split_ts = torch.split(ts_t, lens)
        split_k = [torch.split(k, lens, dim=layout.seq_dim) for k in self._stored(new_k)]
        split_v = [torch.split(v, lens, dim=layout.seq_dim) for v in self._stored(new_v)]
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

    def prefill_steps(self, items: np.ndarray, ts: np.ndarray, into: PrefixKV | None = None,
                      actions: np.ndarray | None = None, context: np.ndarray | None = None) -> Iterator[PrefixKV]:
        """Yields the growing prefix after each chunk; the last value is the whole prefix's K/V. ``into``: an
        empty prefix with room reserved (a KV arena block) that the chunks are written into in place. For a
        model with actions or user context, ``items``/``ts``/``actions``/``context`` are a
        :class:`PrefixTokens` stream (:meth:`prefix_tokens`)."""
        prefix = self.empty_prefix() if into is None else into
        if len(items) == 0:
            yield prefix
            return
        for start in range(0, len(items), self.chunk):
            end = start + self.chunk
            prefix = self.extend(prefix, items[start:end], ts[start:end],
                                 actions[start:end] if actions is not None else None, context)
            yield prefix

    def prefill(self, items: np.ndarray, ts: np.ndarray, into: PrefixKV | None = None,
                actions: np.ndarray | None = None, context: np.ndarray | None = None) -> PrefixKV:
        prefix = self.empty_prefix()
        for prefix in self.prefill_steps(items, ts, into, actions, context):  # noqa: B007
            pass
        return prefix

    def prefill_tokens(self, tokens: PrefixTokens, into: PrefixKV | None = None) -> PrefixKV:
        return self.prefill(tokens.items, tokens.ts, into, tokens.actions, tokens.context)

    # -- ranking ------------------------------------------------------------------------------------
    @torch.no_grad()
    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        """[M_b, num_tasks] logits per request, from its cached prefix plus short-term and candidates."""
        if not reqs:
            return []
        ids, tss, acts, lens, nts = [], [], [], [], []
        for r in reqs:
            s, mc = len(r.short_items), len(r.candidates)
            ids += [r.short_items, r.candidates]
            tss += [r.short_ts, np.full(mc, r.request_ts, dtype=np.int64)]
            if self.action_bits:  # a candidate's action is what is predicted: -1, the "to be predicted" vector
                acts += [r.short_actions if r.short_actions is not None else np.zeros(s, dtype=np.int64),
                         np.full(mc, -1, dtype=np.int64)]
            lens.append(s + mc)
            nts.append(mc)
        ids_t = self._tensor(np.concatenate(ids))
        ts_t = self._tensor(np.concatenate(tss))
        offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
        extra: dict[str, Any] = {"actions": self._tensor(np.concatenate(acts))} if self.action_bits else {}
        x, _, _ = self.model.encode_with_prefix(
            ids_t, ts_t, self._tensor(offsets), [self._computed(p.keys) for p in prefixes],
            [self._computed(p.values) for p in prefixes], [p.timestamps for p in prefixes], num_targets=self._tensor(nts), backend=self.backend, **extra)
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
            prefixes = [self.prefill_tokens(self.item_tokens(reqs[i])) for i in long_reqs]
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
        input_actions = context = None
        if self.action_bits:
            input_actions = self._tensor(np.concatenate([
                np.concatenate([r.long_actions if r.long_actions is not None else np.zeros(len(r.long_items)),
                                r.short_actions if r.short_actions is not None else np.zeros(len(r.short_items))])
                for r in reqs]).astype(np.int64))
        if self.head:
            ctxs = [self._context_ids(r.context) for r in reqs]
            width = max(c.shape[1] for c in ctxs)
            padded = np.zeros((len(reqs), self.head, width), dtype=np.int64)
            for b, c in enumerate(ctxs):
                padded[b, :, :c.shape[1]] = c
            context = self._tensor(padded)
        batch = JaggedBatch(item_ids=self._tensor(np.concatenate(hist)),
                            offsets=kernels.lengths_to_offsets(lengths).to(self.device),
                            timestamps=self._tensor(np.concatenate(hts)), input_actions=input_actions,
                            context=context, host_lengths=tuple(len(h) for h in hist))
        cands = self._tensor(np.stack([r.candidates for r in reqs]))
        cts = self._tensor([r.request_ts for r in reqs])
        full, is_hist = append_candidates(batch, cands, cts)
        x = self.model.encode(full)
        rows = ~is_hist
        logits = self.model.rank_logits(x[rows], full.item_ids[rows]).float()
        return list(torch.split(logits, [len(r.candidates) for r in reqs]))

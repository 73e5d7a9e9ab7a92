"""A :class:`~grstack.runtime.serve.backend.ComputeBackend` that computes nothing and charges what a cost profile says.

The simulator keeps the whole control plane real and replaces only the tensor math: each call is charged the
profile's cost for the sizes the real scheduler logs for it (runtime/serve/step_log.py: the same ``batch``,
``tokens``, ``context`` and ``pairs``, so a profile fitted to real step logs predicts these calls), drawn from the
profile's residual distribution (``tails``) or at its prediction. Prefixes are :class:`CostedPrefix`: only their
timestamps are kept (their length and the versioning need them), and their bytes are the profile model's per
token, so the tiers' byte budgets see paper-scale prefixes (0.47 GB each) without allocating them. Request
canonicalisation (truncation, prefix tokens) is the real engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from grstack.runtime.serve.cost_profile import CostProfile
from grstack.runtime.serve.engine import PrefixKV, PrefixTokens, RankItem, RelayEngine
from grstack.runtime.serve.step_log import attention_pairs


class CostedPrefix(PrefixKV):
    """A prefix with no K/V tensors: its timestamps, and ``bytes_per_token`` bytes per token as the tiers count."""

    def __init__(self, timestamps: torch.Tensor, bytes_per_token: int) -> None:
        super().__init__([], [], timestamps)
        self.bytes_per_token = bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.length * self.bytes_per_token

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixKV:
        return self  # nothing to move; a promotion's time is charged by the simulator (promotion_s)


class CostBackend:
    """``engine``: a real engine of any size (its truncation and token layout are used, never its math);
    ``charge``: told each call's seconds (a virtual clock's charge); ``kv_bytes_per_token``: the simulated
    model's (default: the profile model's, else the engine's); ``tasks``: the served tasks (logits per candidate)."""

    def __init__(self, engine: RelayEngine, profile: CostProfile, charge: Callable[[float], None], *,
                 kv_bytes_per_token: int | None = None, rng: np.random.Generator | None = None,
                 tails: bool = True, tasks: int = 1) -> None:
        self.engine = engine
        self.profile = profile
        self.charge = charge
        per_token = kv_bytes_per_token or profile.model.get("kv_bytes_per_token") or engine.kv_bytes_per_token
        self._bytes_per_token = int(per_token)
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.tails = tails
        self._tasks = tasks  # logits per candidate: one per served task, as the model's rank head gives
        # the prefixes the last call computed: a ranking right after it reads them warm (the chunk step's)
        self._fresh: set[int] = set()

    @property
    def kv_bytes_per_token(self) -> int:
        return self._bytes_per_token

    @property
    def chunk(self) -> int:
        return self.engine.chunk

    def _charge(self, kind: str, new: Sequence[int], context: Sequence[int], cold: int = 0) -> None:
        u = float(self.rng.random()) if self.tails else None
        self.charge(self.profile.step_s(kind, len(new), sum(new), sum(context), attention_pairs(new, context), u,
                                        cold))

    def promotion_s(self, kv: PrefixKV) -> float:
        """Seconds one DRAM-to-device copy of ``kv`` takes at the profile's host-to-device bandwidth (0: none
        stated, a CPU deployment whose tiers are the same memory)."""
        bw = self.profile.transfers.get("host_to_device", 0.0)
        return kv.nbytes / bw if bw > 0 else 0.0

    def _prefix(self, ts: torch.Tensor) -> CostedPrefix:
        return CostedPrefix(ts, self._bytes_per_token)

    def empty_prefix(self) -> PrefixKV:
        return self._prefix(torch.zeros(0, dtype=torch.int64))

    def prefix_tokens(self, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
                      context: np.ndarray | None = None) -> PrefixTokens:
        return self.engine.prefix_tokens(items, ts, actions, context)

    def item_tokens(self, item: RankItem) -> PrefixTokens:
        return self.engine.item_tokens(item)

    def extend_many(self, prefixes: Sequence[PrefixKV], items: Sequence[np.ndarray], ts: Sequence[np.ndarray],
                    actions: Sequence[np.ndarray | None] | None = None,
                    contexts: Sequence[np.ndarray | None] | None = None) -> list[PrefixKV]:
        new = [len(i) for i in items]
        self._charge("extend_many", new, [p.length for p in prefixes])
        out: list[PrefixKV] = [self._prefix(torch.cat([p.timestamps, torch.as_tensor(np.asarray(t, dtype=np.int64))]))
               for p, t in zip(prefixes, ts, strict=True)]
        self._fresh = {id(p) for p in out}
        return out

    def extend(self, prefix: PrefixKV, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
               context: np.ndarray | None = None) -> PrefixKV:
        return self.extend_many([prefix], [items], [ts])[0]

    def prefill_tokens(self, tokens: PrefixTokens, into: PrefixKV | None = None) -> PrefixKV:
        return self.extend(self.empty_prefix(), tokens.items, tokens.ts)

    @staticmethod
    def _suffix(item: RankItem) -> int:
        return len(item.short_items) + len(item.candidates)

    def _logits(self, reqs: Sequence[RankItem]) -> list[torch.Tensor]:
        return [torch.zeros(len(r.candidates), self._tasks) for r in reqs]

    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        """A ranking right after the extend that computed its prefixes (the scheduler's chunk step) reads them
        warm; any other reads them from the cache (``cold``, as the real step log counts a hit's)."""
        context = [p.length for p in prefixes]
        cold = 0 if prefixes and all(id(p) in self._fresh for p in prefixes) else sum(context)
        self._fresh = set()
        self._charge("rank_cached", [self._suffix(r) for r in reqs], context, cold)
        return self._logits(reqs)

    def rank_full(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        self._fresh = set()
        n = [len(self.engine.item_tokens(r)) + self._suffix(r) for r in reqs]
        self._charge("rank_full", n, [0] * len(n))
        return self._logits(reqs)

    def rank_encode(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        return self.rank_full(reqs)

"""What the compute loop needs of the tensor math, as one protocol.

The scheduler and the ranker's profiler call only this, so the math can be the real engine
(:class:`~grstack.runtime.serve.engine.RelayEngine` implements it) or a backend that stands in for it (a cost
model advancing a virtual clock) without the queues, batching, deadlines and caching around it changing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from grstack.runtime.serve.engine import PrefixKV, PrefixTokens, RankItem


class ComputeBackend(Protocol):
    """Prefix K/V building and ranking on one device; stateless, the caller owns caching and scheduling."""

    @property
    def kv_bytes_per_token(self) -> int:
        """Cached bytes per prefix token (what the trigger's and the tiers' byte budgets count)."""
        ...

    @property
    def chunk(self) -> int:
        """Tokens of one prefill chunk; a miss with no more history than this is one full inference."""
        ...

    def empty_prefix(self) -> PrefixKV: ...

    def prefix_tokens(self, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
                      context: np.ndarray | None = None) -> PrefixTokens: ...

    def item_tokens(self, item: RankItem) -> PrefixTokens: ...

    def extend(self, prefix: PrefixKV, items: np.ndarray, ts: np.ndarray, actions: np.ndarray | None = None,
               context: np.ndarray | None = None) -> PrefixKV:
        """``prefix``'s K/V followed by one chunk of new tokens."""
        ...

    def extend_many(self, prefixes: Sequence[PrefixKV], items: Sequence[np.ndarray], ts: Sequence[np.ndarray],
                    actions: Sequence[np.ndarray | None] | None = None,
                    contexts: Sequence[np.ndarray | None] | None = None) -> list[PrefixKV]:
        """:meth:`extend` of several users' prefixes in one call."""
        ...

    def prefill_tokens(self, tokens: PrefixTokens, into: PrefixKV | None = None) -> PrefixKV: ...

    def rank_cached(self, prefixes: list[PrefixKV], reqs: list[RankItem]) -> list[torch.Tensor]:
        """Logits per request from its cached prefix plus its short-term events and candidates."""
        ...

    def rank_full(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        """Full inference: the whole history computed on the critical path."""
        ...

    def rank_encode(self, reqs: list[RankItem]) -> list[torch.Tensor]:
        """Full inference by one dense encode (the oracle the cached paths are checked against)."""
        ...


"""The sequence-aware trigger: pre-infer only requests at risk, within cache-footprint and load budgets.

A prefill costs device memory (its K/V stay cached) and compute (it competes with ranking), so the router
admits a prefill signal only when

1. the request is **at risk**: the latency model profiled from the rankers predicts that full inference at
   this length takes more than ``risk_fraction * slo_ms`` (or the prefix is at least ``length_threshold``
   tokens when that is set explicitly);
2. the **cache footprint** of live admitted prefixes plus this one stays within ``cache_budget_bytes``
   (a prefix stays charged for ``footprint_ttl_s`` after its last admission);
3. the predicted **pre-infer load** of prefills admitted in the last ``window_s`` plus this one stays within
   ``prefill_budget_ms`` (the router sets it to a per-replica, per-second rate x replicas x window; the
   window is long enough that one long prefill fits).

Both budgets are inclusive: a request that lands exactly on a budget is admitted. A signal for a prefix
that is already live (same user, same prefix hash) is admitted again without being charged twice.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def _curve(lengths: tuple[int, ...], values: tuple[float, ...], length: float, power: int) -> float:
    """Piecewise-linear through the measured points (made non-decreasing), ``length**power`` growth past
    the last one, proportional below the first."""
    x = np.asarray(lengths, dtype=np.float64)
    y = np.maximum.accumulate(np.asarray(values, dtype=np.float64))
    if length > x[-1]:
        return float(y[-1] * (length / x[-1]) ** power)
    if length < x[0]:
        return float(y[0] * length / x[0])
    return float(np.interp(length, x, y))


@dataclass(frozen=True)
class LatencyModel:
    """Milliseconds against the long-term prefix length, from the lengths a ranker measured at start-up.

    ``full_ms``: ranking without a cache; ``cached_ms``: ranking against a cached prefix; ``prefill_ms``:
    computing the prefix's K/V (each with the ranker's typical short-term length and candidate count).
    Interpolated between measured lengths (robust to one noisy point, unlike a global fit); extrapolated
    quadratically (full, prefill: attention over the prefix) or linearly (cached) beyond the longest.
    """

    lengths: tuple[int, ...]
    full_ms: tuple[float, ...]
    cached_ms: tuple[float, ...]
    prefill_ms: tuple[float, ...]
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if n == 0 or not (len(self.full_ms) == len(self.cached_ms) == len(self.prefill_ms) == n):
            raise ValueError("a latency model needs the same number (>= 1) of lengths and timings")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:], strict=False)) or self.lengths[0] <= 0:
            raise ValueError("profiled lengths must be positive and increasing")

    def predict_full_ms(self, length: int) -> float:
        return _curve(self.lengths, self.full_ms, length, 2)

    def predict_cached_ms(self, prefix_len: int) -> float:
        return _curve(self.lengths, self.cached_ms, prefix_len, 1)

    def predict_prefill_ms(self, prefix_len: int) -> float:
        return _curve(self.lengths, self.prefill_ms, prefix_len, 2)

    def kv_bytes(self, prefix_len: int) -> int:
        return prefix_len * self.kv_bytes_per_token

    @staticmethod
    def from_profile(lengths: list[int], full: list[float], cached: list[float], prefill: list[float],
                     kv_bytes_per_token: int) -> LatencyModel:
        return LatencyModel(tuple(int(x) for x in lengths), tuple(map(float, full)), tuple(map(float, cached)),
                            tuple(map(float, prefill)), int(kv_bytes_per_token))

    def to_json(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "full_ms": list(self.full_ms), "cached_ms": list(self.cached_ms),
                "prefill_ms": list(self.prefill_ms), "kv_bytes_per_token": self.kv_bytes_per_token}

    @staticmethod
    def from_json(d: dict[str, Any]) -> LatencyModel:
        return LatencyModel.from_profile(d["lengths"], d["full_ms"], d["cached_ms"], d["prefill_ms"],
                                         d["kv_bytes_per_token"])


@dataclass(frozen=True)
class TriggerConfig:
    slo_ms: float = 50.0
    risk_fraction: float = 0.5
    length_threshold: int | None = None
    cache_budget_bytes: int = 1 << 30
    prefill_budget_ms: float = 5000.0  # per window: 50% of one replica's compute over 10 s
    window_s: float = 10.0  # long enough that one long prefill fits in the budget
    footprint_ttl_s: float = 600.0
    # True: every signal is admitted, with no risk check and no budgets (an ablation: pre-infer every visit)
    admit_all: bool = False


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str  # admitted | live | not-at-risk | cache-budget | load-budget | disabled
    predicted_full_ms: float
    predicted_prefill_ms: float
    kv_bytes: int


@dataclass
class SequenceAwareTrigger:
    model: LatencyModel
    config: TriggerConfig = field(default_factory=TriggerConfig)
    clock: Callable[[], float] = time.monotonic
    enabled: bool = True

    def __post_init__(self) -> None:
        self._live: dict[str, tuple[str, int, float]] = {}  # user -> (version, bytes, expires)
        self._live_bytes = 0
        self._load: deque[tuple[float, float]] = deque()  # (admitted at, predicted prefill ms)

    @property
    def live_bytes(self) -> int:
        self._expire(self.clock())
        return self._live_bytes

    @property
    def window_load_ms(self) -> float:
        self._expire(self.clock())
        return self._load_sum()

    def _load_sum(self) -> float:
        return sum(ms for _, ms in self._load)  # summed afresh: no drift, so the budget edge is exact

    def at_risk(self, prefix_len: int) -> tuple[bool, float]:
        full = self.model.predict_full_ms(prefix_len)
        if self.config.length_threshold is not None:
            return prefix_len >= self.config.length_threshold, full
        return full > self.config.risk_fraction * self.config.slo_ms, full

    def _expire(self, now: float) -> None:
        while self._load and self._load[0][0] <= now - self.config.window_s:
            self._load.popleft()
        for user in [u for u, (_, _, exp) in self._live.items() if exp <= now]:
            self._live_bytes -= self._live.pop(user)[1]

    def decide(self, user: str, version: str, prefix_len: int) -> Decision:
        now = self.clock()
        self._expire(now)
        risky, full = self.at_risk(prefix_len)
        prefill = self.model.predict_prefill_ms(prefix_len)
        nbytes = self.model.kv_bytes(prefix_len)
        if not self.enabled:
            return Decision(False, "disabled", full, prefill, nbytes)
        if self.config.admit_all:
            return Decision(True, "admitted", full, prefill, nbytes)
        live = self._live.get(user)
        if live is not None and live[0] == version:
            self._live[user] = (version, live[1], now + self.config.footprint_ttl_s)
            return Decision(True, "live", full, prefill, nbytes)
        if not risky:
            return Decision(False, "not-at-risk", full, prefill, nbytes)
        replaced = live[1] if live is not None else 0  # a new version replaces the user's old entry
        if self._live_bytes - replaced + nbytes > self.config.cache_budget_bytes:
            return Decision(False, "cache-budget", full, prefill, nbytes)
        if self._load_sum() + prefill > self.config.prefill_budget_ms:
            return Decision(False, "load-budget", full, prefill, nbytes)
        self._live[user] = (version, nbytes, now + self.config.footprint_ttl_s)
        self._live_bytes += nbytes - replaced
        self._load.append((now, prefill))
        return Decision(True, "admitted", full, prefill, nbytes)

    def forget(self, user: str) -> None:
        """Releases a user's charge (its prefill failed or its replica went away)."""
        live = self._live.pop(user, None)
        if live is not None:
            self._live_bytes -= live[1]

"""The sequence-aware trigger: pre-infer only requests at risk, within cache-footprint and load budgets.

A prefill costs device memory (its K/V stay cached) and compute (it competes with ranking), so the router
admits a prefill signal only when

1. the request is **at risk**: a miss would take more than ``risk_fraction * slo_ms`` (or the prefix is at
   least ``length_threshold`` tokens when that is set explicitly). A miss's time is the latency model's
   full-inference time at this length (profiled by the rankers at start-up, on an idle ranker), times what
   that ranker's recent steps cost in service against the same profile (``service_cost_factor`` in its
   report, runtime/serve/service_cost.py; with ``in_service_risk``: an idle profile and in-service costs
   differed about 2x on a shared core). With
   ``load_aware_risk`` it is the miss's time *at the SLO's percentile* on the ranker it would go to: the
   sojourn time of an M/M/1 queue, exponential with mean ``full / (1 - ρ)``, at ``slo_percentile``, i.e.
   ``full * ln(1 / (1 - p)) / (1 - ρ)``, ρ the share of time that ranker's compute thread was busy (its
   reported compute, every kind) over the last ``window_s`` or over the last report interval, whichever is
   larger (a burst after a quiet spell counts from the first report that sees it), ``1 - ρ`` floored at
   ``min_idle_fraction``. The SLO bounds the
   P99, not the mean: a miss whose mean fits the budget still misses it one time in a hundred several times
   over, and a rule on the mean leaves exactly the requests that decide the P99 unprotected;
2. the **cache footprint** of admitted prefixes still **awaiting their rank** plus this one stays within
   ``cache_budget_bytes``: a prefix is charged from its admission until the router has routed the user's
   rank (:meth:`SequenceAwareTrigger.consumed`) or ``footprint_ttl_s`` passed. After its rank a prefix is
   one more entry of the ranker's LRU cache, not a reservation;
3. the predicted **pre-infer load** of prefills admitted in the last ``window_s`` plus this one stays within
   ``prefill_budget_ms`` (the router sets it to a per-replica, per-second rate x replicas x window; the
   window is long enough that one long prefill fits).

The load budget bounds **speculative** compute: a prefill whose rank follows replaces the prefix work that
rank would otherwise do by full inference on the critical path (at least as much compute, later and in the
way), so refusing it for load saves nothing and moves that work into the latency. The trigger therefore
counts, over its last ``follow_window`` charged admissions, the share whose rank it saw routed while the
prefix was live (:meth:`SequenceAwareTrigger.consumed`), and charges every load in 3 and below (measured,
pending, predicted) at the **speculative share** ``1 - followed``; with fewer than ``follow_min_samples``
admissions it charges in full. In a cascade, where nearly every signal's rank follows, the budget then binds
only when signals stop being followed (abandoned visits, ranks that went elsewhere, prefixes evicted unused).

Both budgets are inclusive: a request that lands exactly on a budget is admitted. A signal for a prefix
that is already live (same user, same prefix hash) is admitted again without being charged twice; if the
ranker answers that it computed it all the same (it had evicted the prefix), :meth:`charge` charges it.

**Resident footprint, contended load** (at scale, where device memory and compute are scarce; off by
default). ``footprint_tier="device"``: a ranker's footprint budget is a fraction of its *device* capacity,
not device + DRAM: a pre-inferred prefix must be resident in device memory when its rank comes, one in DRAM
costs a promotion. ``footprint_hold_s``: a prefix stays charged that long after its rank was routed, since
the rank still has to queue and read it from device memory. ``contended_busy_fraction``: on a ranker whose
compute thread is at least that busy, loads are charged in full whatever the follow-through, since each
prefill then delays ranks queued behind it.

Per ranker: once the router has a :class:`RankerLoad` report for the replica a signal goes to, the budgets
are that ranker's (2, 3 above are the fallback for a ranker that reports nothing):

* **load**: the prefill milliseconds the ranker itself measured over the last ``window_s`` (its
  ``compute_ms_total["prefill"]`` rate x ``window_s``) + the predicted milliseconds of the prefill tokens in
  its queues + what this router admitted to it since the report + this prefill must stay within
  ``ranker_prefill_budget_ms``. The measured part includes every router's prefills, so several routers
  sharing rankers stay together within the budget. Between two reports a router admits to one ranker at most
  the budget's share of ``report_interval_s`` (or one prefill): the others' admissions since the report are
  unseen, so k routers overshoot by at most k such shares;
* **footprint**: the live prefixes this router admitted to the ranker stay within ``ranker_cache_fraction``
  of the capacity it reports (device + DRAM), or ``ranker_cache_budget_bytes`` when it reports none.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grstack.runtime.serve.clock import Now, SystemClock

SERVED_MAX = 1 << 20  # users whose consumed prefix version is remembered (oldest forgotten first)


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

    def predict_prefill_ms(self, prefix_len: float) -> float:
        return _curve(self.lengths, self.prefill_ms, prefix_len, 2)

    def kv_bytes(self, prefix_len: int) -> int:
        return prefix_len * self.kv_bytes_per_token

    @staticmethod
    def from_profile(lengths: list[int], full: list[float], cached: list[float], prefill: list[float],
                     kv_bytes_per_token: int) -> LatencyModel:
        return LatencyModel(tuple(int(x) for x in lengths), tuple(map(float, full)), tuple(map(float, cached)),
                            tuple(map(float, prefill)), int(kv_bytes_per_token))

    @staticmethod
    def of(profile: Any) -> LatencyModel:
        """The model of a ranker's :class:`~grstack.runtime.serve.schemas.Profile` (the curves it measured)."""
        return LatencyModel.from_profile(profile.lengths, profile.full_ms, profile.cached_ms, profile.prefill_ms,
                                         profile.kv_bytes_per_token)

    def to_json(self) -> dict[str, Any]:
        return {"lengths": list(self.lengths), "full_ms": list(self.full_ms), "cached_ms": list(self.cached_ms),
                "prefill_ms": list(self.prefill_ms), "kv_bytes_per_token": self.kv_bytes_per_token}

    @staticmethod
    def from_json(d: dict[str, Any]) -> LatencyModel:
        return LatencyModel.from_profile(d["lengths"], d["full_ms"], d["cached_ms"], d["prefill_ms"],
                                         d["kv_bytes_per_token"])


def latest_model(profile: Callable[[], Any]) -> Callable[[], LatencyModel | None]:
    """``profile()``'s latency model (None while there is no profile), fitted again only when the profile object
    is replaced (a ranker re-profiled, or a simulated one given its real counterpart's curves)."""
    fitted: list[tuple[Any, LatencyModel]] = []

    def model() -> LatencyModel | None:
        p = profile()
        if p is None:
            return None
        if not fitted or fitted[0][0] is not p:
            fitted[:] = [(p, LatencyModel.of(p))]
        return fitted[0][1]

    return model


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
    # Per-ranker budgets, used for a replica with a fresh RankerLoad report (None: that check is router-wide)
    ranker_prefill_budget_ms: float | None = None  # per ranker per window_s (the router sets it)
    ranker_cache_fraction: float = 0.8  # of the capacity a ranker reports
    ranker_cache_budget_bytes: int | None = None  # per ranker, when it reports no capacity
    report_ttl_s: float = 5.0  # an older report is ignored (the ranker stopped answering its stats)
    # between two reports this trigger admits to one ranker at most its budget's share of this many seconds
    # (always one prefill): what other routers admit meanwhile is unseen until the next report, so k routers
    # overshoot a ranker's budget by at most k such shares (the router sets it to its poll interval)
    report_interval_s: float = 1.0
    # at-risk test against the miss time at the SLO's percentile under the ranker's reported load (module doc,
    # 1), not the idle time
    load_aware_risk: bool = True
    # the profiled (idle, start-up) time scaled by what the ranker's steps cost in service against that profile
    # (its reported service_cost_factor; module doc, 1)
    in_service_risk: bool = True
    min_idle_fraction: float = 0.1
    slo_percentile: float = 99.0  # the percentile the SLO bounds
    # the load budget charges the share of recent admissions whose rank did not follow (module doc)
    follow_window: int = 512  # charged admissions whose outcome is counted
    follow_min_samples: int = 32  # below this many, every load is charged in full
    # Budgets at scale (module doc, "Resident footprint, contended load"); the defaults keep the rules above.
    footprint_tier: str = "cache"  # "cache": a ranker's footprint is of device + DRAM; "device": device only
    footprint_hold_s: float = 0.0  # a routed rank's prefix stays charged this long (its rank still reads it)
    contended_busy_fraction: float | None = None  # a ranker at least this busy: loads are charged in full

    def __post_init__(self) -> None:
        if not 0.0 < self.slo_percentile < 100.0:
            raise ValueError(f"slo_percentile must be in (0, 100), got {self.slo_percentile}")
        if not 0.0 < self.min_idle_fraction <= 1.0:
            raise ValueError(f"min_idle_fraction must be in (0, 1], got {self.min_idle_fraction}")
        if self.footprint_tier not in ("cache", "device"):
            raise ValueError(f"footprint_tier must be 'cache' or 'device', got {self.footprint_tier!r}")
        if self.footprint_hold_s < 0:
            raise ValueError(f"footprint_hold_s must be >= 0, got {self.footprint_hold_s}")
        if self.contended_busy_fraction is not None and not 0.0 <= self.contended_busy_fraction <= 1.0:
            raise ValueError(f"contended_busy_fraction must be in [0, 1], got {self.contended_busy_fraction}")
        if self.follow_window < 1 or not 0 <= self.follow_min_samples <= self.follow_window:
            raise ValueError(f"follow_min_samples must be in [0, follow_window] and follow_window >= 1, got "
                             f"{self.follow_min_samples} and {self.follow_window}")


class RankerLoad:
    """One ranker's load as its ``GET /v1/stats`` reports it, polled by the router.

    Every field of the report is optional (an older ranker reports none of them); a missing field leaves the
    matching budget router-wide. ``observe`` keeps the cumulative prefill compute milliseconds over the last
    ``window_s``, from which the measured prefill rate is taken; a counter that goes back (a restarted ranker)
    starts the history afresh.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.at = 0.0  # time of the last report
        self._prefill_total: deque[tuple[float, float]] = deque()
        self._compute_total: deque[tuple[float, float]] = deque()  # every kind: how busy the compute thread is
        self.reports_compute = False
        self.backlog_tokens = 0
        self.backlog_prefills = 0
        self.queued = 0
        self.resident_bytes = 0
        self.capacity_bytes = 0
        self.device_capacity_bytes = 0
        self.service_cost_factor: float | None = None  # in-service over profiled step costs (service_cost.py)

    def observe(self, stats: dict[str, Any], now: float) -> None:
        self.at = now
        compute = stats.get("compute_ms_total")
        total = compute.get("prefill") if isinstance(compute, dict) else None
        self.reports_compute = total is not None
        if total is not None:
            self._keep(self._prefill_total, float(total), now)
        if isinstance(compute, dict) and compute:
            self._keep(self._compute_total, float(sum(float(v) for v in compute.values())), now)
        else:
            self._compute_total.clear()
        depth = stats.get("queue_depth")
        self.backlog_prefills = int(depth.get("prefills", 0)) if isinstance(depth, dict) else 0
        self.backlog_tokens = int(stats.get("prefill_backlog_tokens", 0) or 0)
        self.queued = int(stats.get("queued", 0) or 0)
        self.resident_bytes = int(stats.get("device_bytes", 0) or 0) + int(stats.get("dram_bytes", 0) or 0)
        self.device_capacity_bytes = int(stats.get("device_capacity_bytes", 0) or 0)
        self.capacity_bytes = self.device_capacity_bytes + int(stats.get("dram_capacity_bytes", 0) or 0)
        factor = stats.get("service_cost_factor")
        self.service_cost_factor = float(factor) if isinstance(factor, int | float) and factor > 0 else None

    def _keep(self, history: deque[tuple[float, float]], total: float, now: float) -> None:
        """Appends a cumulative counter's sample, keeping about ``window_s`` of them (a counter that goes
        back, a restarted ranker, starts afresh)."""
        if history and total < history[-1][1]:
            history.clear()
        history.append((now, total))
        while len(history) > 2 and history[1][0] <= now - self.window_s:
            history.popleft()

    @staticmethod
    def _rate(history: deque[tuple[float, float]]) -> float:
        if len(history) < 2:
            return 0.0
        (t0, v0), (t1, v1) = history[0], history[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0

    @property
    def prefill_rate_ms_per_s(self) -> float:
        """Prefill compute milliseconds per second over the samples kept (0 before a second sample)."""
        return self._rate(self._prefill_total)

    @property
    def busy_fraction(self) -> float | None:
        """Share of time the ranker's compute thread was busy (all kinds of work), in [0, 1]: the larger of
        the last window's share and the last report interval's, so that a burst counts from the first report
        that sees it rather than after it has filled the window; None before two reports with compute totals."""
        history = self._compute_total
        if len(history) < 2:
            return None
        (t0, v0), (t1, v1) = history[-2], history[-1]
        latest = (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0
        return min(1.0, max(0.0, max(self._rate(history), latest) / 1e3))

    def backlog_ms(self, model: LatencyModel) -> float:
        """Predicted milliseconds of the prefill tokens still queued (spread evenly over the queued prefills:
        prefill cost grows faster than linearly, so one sum-length prefill would overstate it)."""
        if self.backlog_tokens <= 0:
            return 0.0
        n = max(1, self.backlog_prefills)
        return n * model.predict_prefill_ms(self.backlog_tokens / n)

    def load_ms(self, model: LatencyModel) -> float | None:
        """Measured prefill ms over a window plus the predicted backlog; None when compute is not reported."""
        if not self.reports_compute:
            return None
        return self.prefill_rate_ms_per_s * self.window_s + self.backlog_ms(model)


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
    clock: Now = field(default_factory=SystemClock)  # budget windows and TTLs; the router passes its own
    enabled: bool = True

    def __post_init__(self) -> None:
        self._live: dict[str, tuple[str, int, float, str | None]] = {}  # user -> (version, bytes, expires, replica)
        # user -> the version whose rank was routed (consumed): most likely still cached, so a repeat signal for
        # it is admitted as live, uncharged (the ranker's answer says if it had to compute it: :meth:`charge`)
        self._served: OrderedDict[str, str] = OrderedDict()
        self._live_bytes = 0
        self._replica_bytes: dict[str | None, int] = {}
        self._load: deque[tuple[float, float, str | None]] = deque()  # (admitted at, predicted ms, replica)
        self.loads: dict[str, RankerLoad] = {}
        # outcome of the last follow_window charged admissions: [followed, still in the window]; a user's
        # newest one by user; _followed counts the followed ones in the window (O(1) per decision)
        self._outcomes: deque[list[bool]] = deque()
        self._pending_outcome: OrderedDict[str, list[bool]] = OrderedDict()  # at most follow_window users
        self._followed = 0
        self._ranked: set[str] = set()  # users whose live charge is the hold after their rank was routed

    @property
    def speculative_share(self) -> float:
        """Share of the recent charged admissions whose rank did not follow while the prefix was live (1.0
        with fewer than ``follow_min_samples`` of them): what the load budget charges of every load."""
        n = len(self._outcomes)
        if n == 0 or n < self.config.follow_min_samples:
            return 1.0
        return 1.0 - self._followed / n

    @property
    def live_bytes(self) -> int:
        self._expire(self.clock())
        return self._live_bytes

    @property
    def window_load_ms(self) -> float:
        self._expire(self.clock())
        return self._load_sum()

    def _load_sum(self) -> float:
        return sum(ms for _, ms, _ in self._load)  # summed afresh: no drift, so the budget edge is exact

    def replica_bytes(self, replica: str) -> int:
        """Bytes of the live prefixes this trigger admitted to ``replica``."""
        self._expire(self.clock())
        return self._replica_bytes.get(replica, 0)

    def pending_ms(self, replica: str) -> float:
        """Predicted prefill ms admitted to ``replica`` since its last load report (all in the window if none)."""
        self._expire(self.clock())
        load = self.loads.get(replica)
        since = load.at if load is not None else float("-inf")
        return sum(ms for t, ms, r in self._load if r == replica and t >= since)

    def report(self, replica: str, stats: dict[str, Any] | None) -> None:
        """Takes a ranker's ``/v1/stats`` (None: it did not answer, its budgets fall back to router-wide)."""
        if stats is None:
            self.loads.pop(replica, None)
            return
        load = self.loads.get(replica)
        if load is None:
            load = self.loads[replica] = RankerLoad(self.config.window_s)
        load.observe(stats, self.clock())

    def _fresh_load(self, replica: str | None, now: float) -> RankerLoad | None:
        load = self.loads.get(replica) if replica is not None else None
        if load is None or load.at < now - self.config.report_ttl_s:
            return None
        return load

    def ranker_load_ms(self, replica: str) -> float | None:
        """The load the per-ranker budget counts for ``replica`` now (None: it falls back to router-wide)."""
        load = self._fresh_load(replica, self.clock())
        measured = load.load_ms(self.model) if load is not None else None
        return None if measured is None else measured + self.pending_ms(replica)

    def miss_ms(self, prefix_len: int, replica: str | None = None) -> float:
        """Predicted time of a miss at this length on ``replica``: the profiled full-inference time (times the
        ranker's reported in-service cost factor, with ``in_service_risk``), or with ``load_aware_risk`` and a
        fresh report its M/M/1 sojourn time at ``slo_percentile`` (module doc, 1)."""
        full = self.model.predict_full_ms(prefix_len)
        load = self._fresh_load(replica, self.clock())
        if self.config.in_service_risk and load is not None and load.service_cost_factor is not None:
            full *= load.service_cost_factor
        if not self.config.load_aware_risk:
            return full
        busy = load.busy_fraction if load is not None else None
        if busy is None:
            return full
        tail = math.log(1.0 / (1.0 - self.config.slo_percentile / 100.0))
        return full * tail / max(1.0 - busy, self.config.min_idle_fraction)

    def at_risk(self, prefix_len: int, replica: str | None = None) -> tuple[bool, float]:
        """(at risk, idle full-inference ms)."""
        full = self.model.predict_full_ms(prefix_len)
        if self.config.length_threshold is not None:
            return prefix_len >= self.config.length_threshold, full
        return self.miss_ms(prefix_len, replica) > self.config.risk_fraction * self.config.slo_ms, full

    def _expire(self, now: float) -> None:
        while self._load and self._load[0][0] <= now - self.config.window_s:
            self._load.popleft()
        for user in [u for u, (_, _, exp, _) in self._live.items() if exp <= now]:
            self._release(user)

    def _release(self, user: str) -> None:
        self._ranked.discard(user)
        live = self._live.pop(user, None)
        if live is not None:
            self._live_bytes -= live[1]
            self._replica_bytes[live[3]] -= live[1]

    def _hold(self, user: str, version: str, nbytes: int, replica: str | None, now: float) -> None:
        self._release(user)
        self._live[user] = (version, nbytes, now + self.config.footprint_ttl_s, replica)
        self._live_bytes += nbytes
        self._replica_bytes[replica] = self._replica_bytes.get(replica, 0) + nbytes

    def _over_budget(self, user: str, replica: str | None, nbytes: int, prefill: float, now: float) -> str | None:
        cfg = self.config
        live = self._live.get(user)
        load = self._fresh_load(replica, now)
        ranker_cache = None
        if load is not None:
            ranker_cache = (cfg.ranker_cache_fraction * load.capacity_bytes if load.capacity_bytes > 0
                            else cfg.ranker_cache_budget_bytes)
        if load is not None and cfg.footprint_tier == "device":  # prefixes must be resident in device memory
            ranker_cache = (cfg.ranker_cache_fraction * load.device_capacity_bytes if load.device_capacity_bytes > 0
                            else cfg.ranker_cache_budget_bytes)
        if ranker_cache is not None:
            replaced = live[1] if live is not None and live[3] == replica else 0
            if self._replica_bytes.get(replica, 0) - replaced + nbytes > ranker_cache:
                return "cache-budget"
        else:
            replaced = live[1] if live is not None else 0  # a new version replaces the user's old entry
            if self._live_bytes - replaced + nbytes > cfg.cache_budget_bytes:
                return "cache-budget"
        measured = load.load_ms(self.model) if load is not None else None
        spec = self._charged_share(load)
        if measured is not None and cfg.ranker_prefill_budget_ms is not None:
            pending = self.pending_ms(replica or "")
            share = cfg.ranker_prefill_budget_ms * cfg.report_interval_s / cfg.window_s
            if (spec * (measured + pending + prefill) > cfg.ranker_prefill_budget_ms
                    or (pending and spec * (pending + prefill) > share)):
                return "load-budget"
        elif spec * (self._load_sum() + prefill) > cfg.prefill_budget_ms:
            return "load-budget"
        return None

    def _charged_share(self, load: RankerLoad | None) -> float:
        """The share of a load the budget charges: all of it on a ranker at least ``contended_busy_fraction``
        busy (pre-inference then queues in front of ranks), else the speculative share."""
        threshold = self.config.contended_busy_fraction
        busy = load.busy_fraction if load is not None else None
        if threshold is not None and busy is not None and busy >= threshold:
            return 1.0
        return self.speculative_share

    def live_version(self, user: str) -> str | None:
        """The prefix version of ``user`` this trigger admitted and still counts as cached, if any."""
        live = self._live.get(user)
        return live[0] if live is not None else None

    def decide(self, user: str, version: str, prefix_len: int, replica: str | None = None) -> Decision:
        """Admit a signal for ``user``'s prefix going to ``replica`` (None: no replica known, router-wide)."""
        now = self.clock()
        self._expire(now)
        risky, full = self.at_risk(prefix_len, replica)
        prefill = self.model.predict_prefill_ms(prefix_len)
        nbytes = self.model.kv_bytes(prefix_len)
        if not self.enabled:
            return Decision(False, "disabled", full, prefill, nbytes)
        if self.config.admit_all:
            return Decision(True, "admitted", full, prefill, nbytes)
        live = self._live.get(user)
        if live is not None and live[0] == version:
            if user not in self._ranked:  # a post-rank hold keeps its own expiry
                self._live[user] = (version, live[1], now + self.config.footprint_ttl_s, live[3])
            return Decision(True, "live", full, prefill, nbytes)
        if live is None and self._served.get(user) == version:
            return Decision(True, "live", full, prefill, nbytes)
        if not risky:
            return Decision(False, "not-at-risk", full, prefill, nbytes)
        over = self._over_budget(user, replica, nbytes, prefill, now)
        if over is not None:
            return Decision(False, over, full, prefill, nbytes)
        self._hold(user, version, nbytes, replica, now)
        self._load.append((now, prefill, replica))
        self._track_outcome(user)
        return Decision(True, "admitted", full, prefill, nbytes)

    def _track_outcome(self, user: str) -> None:
        if len(self._outcomes) == self.config.follow_window:
            old = self._outcomes.popleft()
            old[1] = False
            self._followed -= old[0]
        outcome = [False, True]
        self._outcomes.append(outcome)
        self._pending_outcome[user] = outcome  # an older unfollowed admission of this user stays unfollowed
        self._pending_outcome.move_to_end(user)
        while len(self._pending_outcome) > self.config.follow_window:  # older ones have left the window
            self._pending_outcome.popitem(last=False)

    def charge(self, user: str, version: str, prefix_len: int, replica: str) -> None:
        """Charges a prefill that ``replica`` computed for a signal admitted as live, uncharged (the ranker had
        evicted the prefix): its predicted ms to the ranker's load, its bytes to the ranker's footprint."""
        now = self.clock()
        self._expire(now)
        self._hold(user, version, self.model.kv_bytes(prefix_len), replica, now)
        self._load.append((now, self.model.predict_prefill_ms(prefix_len), replica))
        self._track_outcome(user)

    def forget(self, user: str) -> None:
        """Releases a user's charge (its prefill failed or its replica went away): its rank cannot follow."""
        self._pending_outcome.pop(user, None)
        self._release(user)

    def consumed(self, user: str) -> None:
        """The user's rank was routed: the prefix admitted for it has served, and its bytes stop counting
        against the footprint budget (the ranker keeps or evicts it as any cached entry)."""
        self._expire(self.clock())  # a prefix whose charge expired before its rank was not followed live
        live = self._live.get(user)
        outcome = self._pending_outcome.pop(user, None)
        if live is not None and outcome is not None and not outcome[0]:
            outcome[0] = True
            self._followed += outcome[1]
        if live is not None:
            self._served[user] = live[0]
            self._served.move_to_end(user)
            while len(self._served) > SERVED_MAX:
                self._served.popitem(last=False)
        hold = self.config.footprint_hold_s
        if live is not None and hold > 0 and user not in self._ranked:
            now = self.clock()
            self._live[user] = (live[0], live[1], min(live[2], now + hold), live[3])
            self._ranked.add(user)
            return
        if user not in self._ranked:
            self._release(user)

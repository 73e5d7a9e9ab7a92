"""The router's settings, read by each of its parts (forwarding, health, load, placements)."""

from __future__ import annotations

from dataclasses import dataclass, field

from grstack.runtime.serve.schemas import MAX_BODY_BYTES
from grstack.runtime.serve.trigger import TriggerConfig


@dataclass
class RouterConfig:
    rankers: tuple[str, ...] = ()  # static replicas (embedded mode); empty: discover them in the store
    # "HOST:PORT" of a headless Service: its A/AAAA records (the ready rankers) are the replicas, re-resolved
    # every dns_interval_s, so the ranker count is not baked into the router's arguments.
    rankers_dns: str | None = None
    dns_interval_s: float = 5.0
    # Admitted-prefix footprint per up replica (the trigger's cache budget follows the ranker count); None
    # keeps trigger.cache_budget_bytes as given.
    cache_budget_per_replica_bytes: int | None = None
    relay: bool = True  # False: prefill signals are ignored (the baseline)
    # False: every rank and prefill goes to a uniformly random up replica, placements are ignored (an ablation
    # that measures what cache affinity is worth; a prefix is then found only by chance)
    affinity: bool = True
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    prefill_budget_per_replica_ms: float = 500.0  # predicted pre-infer ms per replica per second
    # -- rankers' load reports (GET /v1/stats): per-ranker trigger budgets, users moved off overloaded replicas
    # GET /v1/stats of every up ranker this often (0: never; the trigger's budgets then stay router-wide)
    load_poll_interval_s: float = 1.0
    # a replica is over its load cap when its requests (this router's in flight, or the queue the ranker
    # reports if longer) exceed load_factor x the mean over up replicas and number at least this many: a
    # placed user then goes where the bounded-load ring says (a cache hit on a short queue beats a miss elsewhere)
    overload_min_load: int = 4
    rank_timeout_s: float = 2.0
    prefill_timeout_s: float = 120.0
    max_attempts: int = 3
    load_factor: float = 1.25
    health_interval_s: float = 1.0
    startup_timeout_s: float = 60.0
    max_body_bytes: int = MAX_BODY_BYTES
    # deadline budget of a rank (ms; None: rank_timeout_s); a client's X-Grstack-Deadline-Ms can only shorten it
    rank_budget_ms: float | None = None
    retry_budget_ratio: float = 0.1  # retries allowed per request over the window
    retry_budget_min: int = 3  # retries allowed per window regardless of traffic
    retry_budget_window_s: float = 10.0
    outlier_consecutive_failures: int = 5  # consecutive 5xx/timeouts that eject a replica
    outlier_base_ejection_s: float = 5.0  # ejection time = base x ejections so far (capped)
    outlier_max_ejection_s: float = 60.0
    outlier_max_ejected_fraction: float = 0.5  # at most this share of replicas ejected (always at least one)
    outlier_latency_factor: float | None = 5.0  # median latency this many times the others' ejects; None: off
    outlier_latency_min_samples: int = 20
    outlier_latency_floor_ms: float = 20.0  # a replica faster than this is never a latency outlier
    # latency outliers are looked for only among at least this many replicas with enough samples (Envoy's
    # success_rate_minimum_hosts, default 5): with fewer, one replica's slowness is as likely the affinity
    # ring's skew (its users are the busy ones) as a fault, and ejecting it moves that load and loses its
    # caches. Consecutive failures eject at any replica count.
    outlier_latency_min_hosts: int = 5
    # Stored placements expire this long after their last write (a new prefill re-writes them); None: they live
    # as long as their replica's lease.
    placement_ttl_s: float | None = 3600.0
    # Store only placements that differ from the user's ring home over the registered replicas.
    placement_exceptions_only: bool = True

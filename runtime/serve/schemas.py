"""Request and response models of the ranker and router HTTP APIs (the OpenAPI document is built from them).

Types are strict (a string is not an item id, a float is not a timestamp) and unknown fields are rejected,
so client mistakes come back as 422 with the offending field named instead of silently coerced.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

# Hard caps that hold for every deployment; a ranker may be configured tighter (see RankerConfig).
MAX_EVENTS = 100_000
MAX_CANDIDATES = 10_000
MAX_BODY_BYTES = 4 * 1024 * 1024

ItemId = Annotated[int, Field(strict=True, ge=1, le=2**62)]
Timestamp = Annotated[int, Field(strict=True, ge=0, le=2**62)]
UserId = Annotated[str, Field(strict=True, min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@-]+$")]
ActionBits = Annotated[int, Field(strict=True, ge=0, le=2**62)]
FeatureName = Annotated[str, Field(strict=True, min_length=1, max_length=128)]
FeatureValue = Annotated[str, Field(strict=True, max_length=256)]
MAX_USER_FIELDS = 64
MAX_FIELD_VALUES = 256
UserFeatures = Annotated[dict[FeatureName, Annotated[list[FeatureValue], Field(max_length=MAX_FIELD_VALUES)]],
                         Field(max_length=MAX_USER_FIELDS, description=(
                             "the user's attribute values by field (raw tokens as in the training data, e.g. "
                             '{"age": ["25"], "gender": ["M"]}), for a model trained with user context '
                             "(data.user_features); a field left out or a value the model never saw counts as "
                             "no value"))]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Events(_Model):
    """A time-ordered behaviour sequence: item ids and their timestamps (seconds), equally long; with
    ``actions``, each event's action bits too (what the user did with the item: the model's action names in
    bit order, e.g. click = 1, like = 2, long_view = 4), which a model trained with model.action_inputs
    requires and other models ignore."""

    items: list[ItemId] = Field(default_factory=list, max_length=MAX_EVENTS)
    timestamps: list[Timestamp] = Field(default_factory=list, max_length=MAX_EVENTS)
    actions: list[ActionBits] | None = Field(None, max_length=MAX_EVENTS)

    @model_validator(mode="after")
    def _same_length(self) -> Events:
        if len(self.items) != len(self.timestamps):
            raise ValueError(f"items ({len(self.items)}) and timestamps ({len(self.timestamps)}) must have the "
                             f"same length")
        if self.actions is not None and len(self.actions) != len(self.items):
            raise ValueError(f"actions ({len(self.actions)}) and items ({len(self.items)}) must have the same "
                             f"length")
        return self


class PrefillRequest(_Model):
    """The pre-infer signal, sent at retrieval time with the user's long-term behaviours."""

    user_id: UserId
    long_term: Events
    user_features: UserFeatures | None = None
    wait: StrictBool = Field(False, description="router: answer after the ranker finished the prefill")

    @model_validator(mode="after")
    def _nonempty(self) -> PrefillRequest:
        if not self.long_term.items:
            raise ValueError(f"user {self.user_id!r} has no long-term history to pre-infer")
        return self


class RankRequest(_Model):
    """Score candidates for a user: long-term + short-term behaviours, then the candidates."""

    user_id: UserId
    long_term: Events = Field(default_factory=Events)
    short_term: Events = Field(default_factory=Events)
    candidates: list[ItemId] = Field(min_length=1, max_length=MAX_CANDIDATES)
    timestamp: Timestamp | None = Field(None, description="request time (default: the last event's)")
    user_features: UserFeatures | None = None

    @model_validator(mode="after")
    def _has_history(self) -> RankRequest:
        if not self.long_term.items and not self.short_term.items:
            raise ValueError(f"user {self.user_id!r} has no history (long_term and short_term are empty)")
        return self

    def request_ts(self) -> int:
        if self.timestamp is not None:
            return self.timestamp
        last = self.short_term.timestamps or self.long_term.timestamps
        return last[-1]


class PrefillResponse(_Model):
    user_id: str
    replica: str
    prefix_hash: str
    prefix_len: int
    status: Literal["computed", "cached", "promoted", "joined"]
    kv_bytes: int
    compute_ms: float
    reused_len: int = Field(0, description="prefix tokens reused from the user's cached older prefix "
                                           "(incremental prefill; 0: computed from scratch or not computed)")


class RankResponse(_Model):
    user_id: str
    replica: str
    tasks: list[str]
    scores: list[list[float]] = Field(description="[candidate][task] logits, in request order")
    cache: Literal["device", "dram", "miss"]
    prefix_hash: str
    prefix_len: int
    short_len: int
    truncated: int = Field(description="oldest history tokens dropped to fit the model's max_len")
    queue_ms: float
    compute_ms: float
    reused_len: int = Field(0, description="a miss: prefix tokens reused from the user's cached older prefix "
                                           "(only the newer ones were computed, and the new prefix is cached)")
    joined_ms: float = Field(0.0, description="time this rank waited for its prefix's in-flight prefill (it "
                                              "joined that prefill instead of recomputing; cache is then device)")


class RouterPrefillResponse(_Model):
    user_id: str
    admitted: bool
    reason: str
    replica: str | None
    prefix_len: int
    predicted_full_ms: float
    ranker: PrefillResponse | None = None


class ErrorResponse(_Model):
    error: str
    status: int


class Health(_Model):
    status: Literal["ok", "starting", "unavailable"]
    detail: dict[str, Any] = Field(default_factory=dict)


class Profile(_Model):
    """What a ranker measured at start-up; the router fits its latency model to it."""

    replica: str
    max_len: int
    max_suffix: int
    max_candidates: int
    candidates: int
    lengths: list[int]
    full_ms: list[float]
    cached_ms: list[float]
    prefill_ms: list[float]
    kv_bytes_per_token: int
    tasks: list[str]
    num_items: int
    action_names: list[str] = Field(default_factory=list, description="the action bits the model reads from "
                                    "each event (model.action_inputs); empty: it reads none")
    user_fields: list[str] = Field(default_factory=list, description="the user-feature fields the model reads "
                                   "(its contextual tokens); empty: none")


class CacheStatsModel(_Model):
    replica: str
    device_hits: int
    dram_hits: int
    misses: int
    promotions: int
    device_bytes: int
    dram_bytes: int
    device_entries: int
    dram_entries: int
    prefills_computed: int
    ranks: int
    queued: int = Field(description="requests and prefills waiting for compute")
    device_capacity_bytes: int = Field(0, description="device-tier budget of the prefix cache")
    dram_capacity_bytes: int = Field(0, description="DRAM-tier budget of the prefix cache")
    queue_depth: dict[str, int] = Field(default_factory=dict, description="waiting work by queue: hits, "
                                                                          "misses, prefills")
    prefill_backlog_tokens: int = Field(0, description="prefix tokens still to compute in the queues")
    compute_ms_total: dict[str, float] = Field(
        default_factory=dict, description="cumulative compute-thread milliseconds by kind: prefill (pre-infer "
                                          "signals, also when a rank joined them), rank_cached, rank_full (misses)")
    prefill_tokens_computed: int = Field(0, description="prefix tokens pushed through prefill/extend, including "
                                                       "the prefixes of cache-miss ranks")
    prefill_tokens_without_incremental: int = Field(0, description="what a from-scratch prefill would have "
                                                                  "computed for the same work")
    incremental_prefills: int = Field(0, description="prefills and misses that extended a cached older prefix")
    joined_ranks: int = Field(0, description="ranks that found their prefix being prefilled and joined it (their "
                                             "answer says cache 'device'; counted as misses above)")
    service_cost_factor: float | None = Field(
        None, description="recent single-user steps' milliseconds over what the start-up profile predicts for "
                          "them (runtime/serve/service_cost.py); null before enough steps")


class StepEntry(_Model):
    """One compute step (runtime/serve/step_log.py, StepRecord)."""

    seq: int
    t: float = Field(description="when it started, on the ranker's clock (seconds)")
    kind: Literal["rank_cached", "rank_full", "extend_many"]
    batch: int = Field(description="users in the step")
    tokens: int = Field(description="new tokens computed")
    context: int = Field(description="cached prefix tokens attended to, summed over the batch")
    pairs: int = Field(description="attention query-key pairs (n·c + n(n+1)/2 per user)")
    seconds: float
    cpu_seconds: float | None = Field(None, description="the compute thread's CPU seconds in the step (seconds "
                                      "minus this: the time its core gave to other threads meanwhile)")
    cold: int = Field(0, description="context tokens read from the cache (a hit's ranking), not right after the "
                      "step that computed them")


class RequestEntry(_Model):
    """One request's CPU on the ranker's event-loop thread outside the steps (step_log.py, RequestRecord)."""

    seq: int
    t: float
    endpoint: Literal["rank", "prefill"]
    events: int
    candidates: int
    parse_s: float
    encode_s: float
    reply_s: float


class StepsResponse(_Model):
    """``GET /v1/steps?since=N``: the records numbered above ``since`` still in the rings."""

    replica: str
    capacity: int = Field(description="records each ring holds")
    steps: list[StepEntry]
    steps_dropped: int = Field(description="step records above since overwritten before this read")
    requests: list[RequestEntry]
    requests_dropped: int
    next_since: int = Field(description="the last step number returned or known: pass it as since next time")
    next_requests_since: int

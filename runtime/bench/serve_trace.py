"""Visit traces for ``grstack bench serve``: pure, seeded functions (no I/O, no clock).

Where the visits come from: the users of ``runtime.data.synth`` (KuaiRand-27K-like event streams: events
seconds to minutes apart inside a session, sessions hours to days apart, heavier users come back sooner).
A gap of 10 minutes or more starts a session (synth's between-session gaps are at least 600 s; a
within-session gap that long has probability ~2e-4 and then simply splits the session).

* **Window**: a point looks at ``window_h`` hours of the stream starting a week in (every synthetic user
  has started by then). Only sessions that start inside the window are visited.
* **Activity**: synth's per-user activity is lognormal (top 1% of users ~10% of events), not Zipf-like, so
  each user's visit intensity is drawn Zipf(``zipf``) over users ranked by their synthetic activity (the
  heaviest user gets rank 1): a session of user u is visited with probability min(1, c * z_u / s_u), s_u
  the user's sessions in the window, c set so the window holds the visits the point needs. The cap (a user
  cannot visit more sessions than she has) flattens the very top; the achieved skew is reported.
* **Visits inside a session**: the session's first event, then each later event with ``burst_prob`` — visits
  come in bursts.
* **Histories**: long-term = a per-point base of ``length`` older events (random items, timestamps before
  the window), then the user's synthetic events inside the window before the current session started: the
  same for every visit of a session, growing between sessions (incremental prefixes). Short-term = the
  session's events before the visit (the last ``max_short``); the first visit of a session has none, so it
  carries the session's first event (the visit's own event: what the user is doing when the request comes).
* **Wall clock**: the visits' stream times, shifted to 0 and scaled linearly so the mean rate is ``qps``
  (bursts keep their shape). Each visit's pre-infer signal goes at that time and its rank request
  ``gap_ms`` x U(1 - jitter, 1 + jitter) later (the cascade gap: retrieval and pre-processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SESSION_GAP_S = 600
WEEK_S = 7 * 86_400


@dataclass(frozen=True)
class TraceConfig:
    users: int = 2000
    length: int = 1024  # base long-term events every user has before the window
    qps: float = 40.0
    warmup: int = 250  # visits sent first and not measured
    measured: int = 1000
    gap_ms: float = 50.0
    jitter: float = 0.2
    max_short: int = 64
    candidates: int = 64
    burst_prob: float = 0.3
    window_h: float = 24.0
    zipf: float = 1.1
    min_user_gap_s: float = 1.0  # wall-clock gap between one user's consecutive visits, at least
    seed: int = 0


@dataclass
class Visit:
    user: int  # index into the population
    t: int  # stream time (s)
    wall_s: float  # the pre-infer signal's send time (s from the start of the point)
    rank_s: float  # the rank request's send time
    long_items: np.ndarray
    long_ts: np.ndarray
    short_items: np.ndarray
    short_ts: np.ndarray
    candidates: np.ndarray
    session: int  # global session index
    grew: bool | None  # None: the user's first visit in the trace; else whether the prefix grew since the last


@dataclass
class Trace:
    config: TraceConfig
    visits: list[Visit] = field(default_factory=list)
    num_items: int = 0
    shape: dict[str, float | int | None] = field(default_factory=dict)

    @property
    def max_long(self) -> int:
        return max((len(v.long_items) for v in self.visits), default=0)


@dataclass
class Population:
    """A synthetic user population flattened to events with session ids (kept between points)."""

    offsets: np.ndarray  # [U + 1]
    items: np.ndarray
    ts: np.ndarray
    session_first: np.ndarray  # [E] bool
    num_items: int
    start_time: int


def population(users: int, seed: int) -> Population:
    """``users`` KuaiRand-27K-like users (synth's ``27k`` preset) with sessions marked."""
    from grstack.runtime.data import synthesize

    ds = synthesize("27k", seed, num_users=users)
    ts = np.asarray(ds.timestamps, dtype=np.int64)
    offsets = np.asarray(ds.offsets, dtype=np.int64)
    first = np.zeros(len(ts), dtype=bool)
    first[1:] = np.diff(ts) >= SESSION_GAP_S
    first[offsets[:-1]] = True
    return Population(offsets, np.asarray(ds.item_ids, dtype=np.int64), ts, first, int(ds.num_items),
                      int(ds.info["config"]["start_time"]))


def zipf_weights(activity: np.ndarray, s: float) -> np.ndarray:
    """Zipf(s) weights over users ranked by ``activity`` (most active: rank 1), summing to 1."""
    rank = np.empty(len(activity), dtype=np.int64)
    rank[np.argsort(-activity, kind="stable")] = np.arange(1, len(activity) + 1)
    w = rank.astype(np.float64) ** -s
    return w / w.sum()


def _session_probs(z: np.ndarray, sessions: np.ndarray, visits_per_session: float, needed: int) -> np.ndarray:
    """p_u = min(1, c z_u / s_u) with c such that the expected visits reach ``needed`` (bisection)."""
    has = sessions > 0
    cap = float((sessions[has] * visits_per_session).sum())
    p = np.zeros(len(z))
    if cap <= needed:
        p[has] = 1.0
        return p
    lo, hi = 0.0, 1.0
    while float((np.minimum(1.0, hi * z[has] / sessions[has]) * sessions[has]).sum()) * visits_per_session < needed:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        got = float((np.minimum(1.0, mid * z[has] / sessions[has]) * sessions[has]).sum()) * visits_per_session
        lo, hi = (mid, hi) if got < needed else (lo, mid)
    p[has] = np.minimum(1.0, hi * z[has] / sessions[has])
    return p


def _cap_per_user(idx: np.ndarray, user_of: np.ndarray, ts: np.ndarray, cap: int) -> np.ndarray:
    """The earliest ``cap`` of each user's events among ``idx``, in time order."""
    by_user = idx[np.lexsort((ts[idx], user_of[idx]))]
    users = user_of[by_user]
    first = np.ones(len(by_user), dtype=bool)
    first[1:] = users[1:] != users[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(len(by_user)), 0))
    kept = by_user[np.arange(len(by_user)) - start < cap]
    return kept[np.argsort(ts[kept], kind="stable")]


def _schedule(order: np.ndarray, user_of: np.ndarray, qps: float, min_gap: float,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Send times: Poisson arrivals at ``qps``, each given to the earliest visit (in stream order) whose user
    has not visited in the last ``min_gap`` seconds. Returns the visits in send order and their times.

    A linear rescale of the stream's own times would squeeze a day into the point (a user's visits
    milliseconds apart); stretching it and pushing visits apart instead piles them up at multiples of the gap.
    This keeps the aggregate rate Poisson at the point's QPS, each user's visits in their stream order and at
    least ``min_gap`` apart, and the visits otherwise in stream order."""
    pending = [int(e) for e in order]
    slots = np.cumsum(rng.exponential(1.0 / qps, len(pending)))
    slots -= slots[0]
    ready: dict[int, float] = {}
    sent, times = [], []
    now = 0.0
    for slot in slots:
        now = max(now, float(slot))
        pick = next((i for i, e in enumerate(pending) if ready.get(int(user_of[e]), -np.inf) <= now), None)
        if pick is None:  # every waiting user visited within the gap: the earliest to become ready goes next
            pick = min(range(len(pending)), key=lambda i: ready[int(user_of[pending[i]])])
            now = ready[int(user_of[pending[pick]])]
        e = pending.pop(pick)
        ready[int(user_of[e])] = now + min_gap
        sent.append(e)
        times.append(now)
    return np.asarray(sent, dtype=np.int64), np.asarray(times)


def build_trace(pop: Population, cfg: TraceConfig) -> Trace:
    """The visits of one point: ``cfg.warmup + cfg.measured`` of them, in send order."""
    rng = np.random.default_rng([cfg.seed, 7])  # which visits: the same at every length and QPS
    fill = np.random.default_rng([cfg.seed, cfg.length, 11])  # base histories and candidates
    needed = cfg.warmup + cfg.measured
    n_users = len(pop.offsets) - 1
    user_of = np.repeat(np.arange(n_users), np.diff(pop.offsets))
    sess_id = np.cumsum(pop.session_first) - 1
    sess_first_idx = np.flatnonzero(pop.session_first)
    t0 = pop.start_time + WEEK_S
    events_per_session = len(pop.ts) / max(1, len(sess_first_idx))
    per_session = 1.0 + cfg.burst_prob * max(0.0, events_per_session - 1.0)
    window = cfg.window_h * 3600.0
    while True:  # a small population may need a longer window
        in_win = (pop.ts[sess_first_idx] >= t0) & (pop.ts[sess_first_idx] < t0 + window)
        sessions = np.bincount(user_of[sess_first_idx[in_win]], minlength=n_users)
        if sessions.sum() * per_session >= 1.3 * needed or window > 400 * 86_400:
            break
        window *= 2
    # One user cannot ask for rankings faster than every min_user_gap_s: a point lasting needed/qps seconds
    # holds at most this many of a user's visits (a higher QPS comes from more users, not faster ones).
    # (half of it: a heavy user must share the arrivals with everyone else and still fit in the point)
    cap = max(1, int(0.5 * needed / cfg.qps / cfg.min_user_gap_s) + 1) if cfg.min_user_gap_s > 0 else needed
    z = zipf_weights(np.diff(pop.offsets).astype(np.float64), cfg.zipf)
    p = _session_probs(z, sessions, per_session, int(needed * 1.15))
    while True:
        chosen_sess = sess_first_idx[in_win][rng.random(int(in_win.sum())) < p[user_of[sess_first_idx[in_win]]]]
        chosen = np.zeros(len(pop.ts), dtype=bool)
        chosen[chosen_sess] = True
        # later events of a chosen session: same session id as a chosen first event
        sess_chosen = np.zeros(int(sess_id[-1]) + 1, dtype=bool)
        sess_chosen[sess_id[chosen_sess]] = True
        later = sess_chosen[sess_id] & ~pop.session_first & (rng.random(len(pop.ts)) < cfg.burst_prob)
        idx = _cap_per_user(np.flatnonzero(chosen | later), user_of, pop.ts, cap)
        if len(idx) >= needed or np.all(p[sessions > 0] >= 1.0):
            break
        p = np.minimum(1.0, p * 1.5)
    order = idx[np.argsort(pop.ts[idx], kind="stable")][:needed]
    if len(order) < needed:
        from grstack.runtime.errors import UserError

        raise UserError(f"bench serve: {n_users} users give only {len(order)} visits; need {needed} "
                        f"(more --users, or fewer --measured/--warmup)")
    t_vis = pop.ts[order]
    order, wall = _schedule(order, user_of, cfg.qps, cfg.min_user_gap_s, np.random.default_rng([cfg.seed, 13]))
    gaps = cfg.gap_ms / 1e3 * fill.uniform(1 - cfg.jitter, 1 + cfg.jitter, needed)
    trace = Trace(cfg, num_items=pop.num_items)
    base: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    last_len: dict[int, int] = {}
    for k, e in enumerate(order):
        u = int(user_of[e])
        if u not in base:
            items = fill.integers(1, pop.num_items + 1, cfg.length)
            ts = t0 - 1 - np.cumsum(fill.integers(30, 3600, cfg.length))[::-1]
            base[u] = (items, ts)
        s_first = int(sess_first_idx[sess_id[e]])
        lo = int(pop.offsets[u])
        win_lo = lo + int(np.searchsorted(pop.ts[lo:s_first], t0))
        long_items = np.concatenate([base[u][0], pop.items[win_lo:s_first]])
        long_ts = np.concatenate([base[u][1], pop.ts[win_lo:s_first]])
        short_lo = max(s_first, int(e) - cfg.max_short)
        if e > s_first:
            short_items, short_ts = pop.items[short_lo:e], pop.ts[short_lo:e]
        else:
            short_items, short_ts = pop.items[e:e + 1], pop.ts[e:e + 1]
        prev = last_len.get(u)
        last_len[u] = len(long_items)
        trace.visits.append(Visit(user=u, t=int(pop.ts[e]), wall_s=float(wall[k]), rank_s=float(wall[k] + gaps[k]),
                                  long_items=long_items, long_ts=long_ts, short_items=short_items,
                                  short_ts=short_ts, candidates=fill.integers(1, pop.num_items + 1, cfg.candidates),
                                  session=int(sess_id[e]), grew=None if prev is None else len(long_items) > prev))
    trace.shape = trace_shape(trace, n_users, float(t_vis.max() - t_vis.min()) / 3600.0)
    return trace


def trace_shape(trace: Trace, population_users: int, span_h: float) -> dict[str, float | int | None]:
    """What the JSON reports about a trace: who visits, how often, how histories grow."""
    users = np.array([v.user for v in trace.visits])
    _, per_user = np.unique(users, return_counts=True)
    top = max(1, int(np.ceil(0.01 * population_users)))  # of the population: users without visits count
    sessions: dict[int, set[int]] = {}
    for v in trace.visits:
        sessions.setdefault(v.user, set()).add(v.session)
    repeat = [v.grew for v in trace.visits if v.grew is not None]
    q = np.quantile(per_user, [0.5, 0.9, 0.99, 1.0]) if len(per_user) else [0, 0, 0, 0]
    last: dict[int, float] = {}
    gaps = []
    for v in trace.visits:
        if v.user in last:
            gaps.append(v.wall_s - last[v.user])
        last[v.user] = v.wall_s
    walls = [v.wall_s for v in trace.visits]
    return {"population_users": population_users, "users": len(per_user), "visits": len(trace.visits),
            "visits_per_user_p50": float(q[0]), "visits_per_user_p90": float(q[1]),
            "visits_per_user_p99": float(q[2]), "visits_per_user_max": float(q[3]),
            "top1pct_population_visit_share": float(np.sort(per_user)[::-1][:top].sum() / max(1, len(users))),
            "sessions_per_user_mean": float(np.mean([len(s) for s in sessions.values()])) if sessions else 0.0,
            "mean_long_term_len": float(np.mean([len(v.long_items) for v in trace.visits])),
            "max_long_term_len": trace.max_long,
            "repeat_visit_fraction": len(repeat) / max(1, len(trace.visits)),
            "prefix_grew_fraction": (sum(repeat) / len(repeat)) if repeat else None,
            "stream_span_h": span_h, "wall_span_s": (max(walls) - min(walls)) if walls else 0.0,
            "user_gap_wall_s_p50": float(np.median(gaps)) if gaps else None,
            "user_gap_wall_s_min": float(min(gaps)) if gaps else None}

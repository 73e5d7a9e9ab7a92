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
* **Histories**: long-term = a per-user base of older events (random items, timestamps before the window),
  then the user's synthetic events inside the window before the current session started: the same for every
  visit of a session, growing between sessions (incremental prefixes). The base is heterogeneous
  (``length_dist="kuairand"``): the user's synthetic history length (synth's ``27k`` preset, lognormal with
  median 450 and sigma 1.0 clipped to 100-10,000, as KuaiRand-27K's) scaled so that the median user has
  ``length``, so heavier users have longer histories; ``"fixed"`` gives every user ``length``. Short-term =
  the session's events before the visit (the last ``max_short``); the first visit of a session has none, so
  it carries the session's first event (the visit's own event: what the user is doing when the request comes).
* **Cache pressure**: with ``kv_bytes_per_token`` and ``device_cache_bytes`` (all rankers' device tiers), the
  per-user visit cap is halved until the prefixes of the users a point visits need ``cache_pressure`` times
  the device memory at ``pressure_length`` (a higher pressure comes from more users, not longer histories;
  a population too small for it keeps the last cap that fills the point and reports the pressure reached).
* **Wall clock**: Poisson arrivals at ``qps``, one user's visits at least ``min_user_gap_s`` apart and, from
  one session to the next, at least ``dram_ttl_s`` apart: the time compression squeezes the hours between
  sessions down to the DRAM tier's TTL, never below it, so no cross-session reuse comes from the compression.
  Each visit's pre-infer signal goes at that time and, with probability ``follow_through``, its rank request
  ``gap_ms`` x U(1 - jitter, 1 + jitter) later (the cascade gap); the other signals' ranks never come (the
  user was retrieved but dropped further down the cascade).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

SESSION_GAP_S = 600
WEEK_S = 7 * 86_400
LENGTH_DISTS = ("kuairand", "fixed")


@dataclass(frozen=True)
class TraceConfig:
    users: int = 2000
    length: int = 1024  # the median user's base long-term events before the window ("fixed": every user's)
    qps: float = 40.0
    warmup: int = 250  # visits sent first and not measured
    measured: int = 1000  # measured rank requests (visits whose rank comes)
    gap_ms: float = 50.0
    jitter: float = 0.2
    max_short: int = 64
    candidates: int = 64
    burst_prob: float = 0.3
    window_h: float = 24.0
    zipf: float = 1.1
    min_user_gap_s: float = 1.0  # wall-clock gap between one user's consecutive visits, at least
    seed: int = 0
    length_dist: str = "kuairand"  # or "fixed" (every user's base is ``length``)
    max_length: int = 50_000  # a user's base is clipped here (half of what a request may carry)
    follow_through: float = 0.8  # share of pre-infer signals whose rank request comes
    dram_ttl_s: float = 600.0  # the rankers' DRAM TTL: what reuse_share counts as still cached
    keep_sessions_apart: bool = True  # a user's next session at least dram_ttl_s after her last visit (wall)
    kv_bytes_per_token: int = 0  # the served model's cached bytes per prefix token (0: not sized)
    device_cache_bytes: int = 0  # every ranker's device tier together (0: not sized)
    cache_pressure: float = 10.0  # visited users' prefixes / device cache to reach, when both are given
    pressure_length: int = 0  # the ``length`` the pressure is sized at (0: ``length``; see build_trace)


@dataclass
class Visit:
    user: int  # index into the population
    t: int  # stream time (s)
    wall_s: float  # the pre-infer signal's send time (s from the start of the point)
    rank_s: float  # the rank request's send time (when ``ranked``)
    long_items: np.ndarray
    long_ts: np.ndarray
    short_items: np.ndarray
    short_ts: np.ndarray
    candidates: np.ndarray
    session: int  # global session index
    grew: bool | None  # None: the user's first visit in the trace; else whether the prefix grew since the last
    ranked: bool = True  # False: the signal's rank never comes (follow-through)


@dataclass
class Trace:
    config: TraceConfig
    visits: list[Visit] = field(default_factory=list)
    num_items: int = 0
    shape: dict[str, float | int | str | None] = field(default_factory=dict)

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


def base_lengths(pop: Population, cfg: TraceConfig) -> np.ndarray:
    """Each user's base long-term length: her synthetic history length scaled so the median user has
    ``cfg.length`` (``"kuairand"``), or ``cfg.length`` for every user (``"fixed"``); within 1..max_length."""
    n_users = len(pop.offsets) - 1
    if cfg.length_dist == "fixed":
        return np.full(n_users, min(cfg.length, cfg.max_length), dtype=np.int64)
    events = np.diff(pop.offsets).astype(np.float64)
    scaled = np.rint(cfg.length * events / max(1.0, float(np.median(events))))
    return np.clip(scaled, 1, cfg.max_length).astype(np.int64)


def _cap_sessions(idx: np.ndarray, user_of: np.ndarray, sess_id: np.ndarray, cap: int) -> np.ndarray:
    """The events among ``idx`` (in time order) in each user's earliest ``cap`` sessions."""
    seen: dict[int, list[int]] = {}
    keep = np.zeros(len(idx), dtype=bool)
    for k, e in enumerate(idx):
        got = seen.setdefault(int(user_of[e]), [])
        s = int(sess_id[e])
        if s in got or len(got) < cap:
            if s not in got:
                got.append(s)
            keep[k] = True
    return idx[keep]


def _schedule(order: np.ndarray, user_of: np.ndarray, sess_id: np.ndarray, qps: float, min_gap: float,
              session_gap: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Send times: Poisson arrivals at ``qps``, each given to the earliest visit (in stream order) whose user
    is ready: her last visit at least ``min_gap`` ago, or ``session_gap`` when this visit starts another
    session. Returns the visits in send order and their times.

    A linear rescale of the stream's own times would squeeze a day into the point (a user's visits
    milliseconds apart); stretching it and pushing visits apart instead piles them up at multiples of the gap.
    This keeps the aggregate rate Poisson at the point's QPS, each user's visits in their stream order and
    the gaps, and the visits otherwise in stream order (a user's head visit is her earliest, so the earliest
    ready visit is the earliest head among the ready users: two heaps)."""
    queues: dict[int, list[int]] = {}
    for pos, e in enumerate(order):
        queues.setdefault(int(user_of[e]), []).append(pos)
    heads = {u: 0 for u in queues}
    ready = [(q[0], u) for u, q in queues.items()]  # (stream position of the head, user)
    heapq.heapify(ready)
    waiting: list[tuple[float, int, int]] = []  # (ready time, stream position of the head, user)
    slots = np.cumsum(rng.exponential(1.0 / qps, len(order)))
    slots -= slots[0]
    sent, times = [], []
    now = 0.0
    for slot in slots:
        now = max(now, float(slot))
        while waiting and waiting[0][0] <= now:
            _, pos, u = heapq.heappop(waiting)
            heapq.heappush(ready, (pos, u))
        if not ready:  # every waiting user visited within her gap: the earliest to become ready goes next
            at, pos, u = heapq.heappop(waiting)
            now = at
            heapq.heappush(ready, (pos, u))
        pos, u = heapq.heappop(ready)
        e = int(order[pos])
        sent.append(e)
        times.append(now)
        heads[u] += 1
        if heads[u] < len(queues[u]):
            nxt = queues[u][heads[u]]
            gap = session_gap if sess_id[order[nxt]] != sess_id[e] else min_gap
            heapq.heappush(waiting, (now + max(min_gap, gap), nxt, u))
    return np.asarray(sent, dtype=np.int64), np.asarray(times)


def signals_needed(cfg: TraceConfig) -> int:
    """Visits a point sends: the warm-up, then enough for ``measured`` ranks at the follow-through f (the
    ranks of n signals are Binomial(n, f): 4 standard deviations over the mean n = measured / f)."""
    f = cfg.follow_through
    return cfg.warmup + math.ceil((cfg.measured + 4.0 * math.sqrt(cfg.measured * (1.0 - f))) / f)


def _check(cfg: TraceConfig) -> None:
    from grstack.runtime.errors import UserError

    if cfg.length_dist not in LENGTH_DISTS:
        raise UserError(f"bench serve trace: length_dist must be one of {LENGTH_DISTS}, got {cfg.length_dist!r}")
    if not 0.0 < cfg.follow_through <= 1.0:
        raise UserError(f"bench serve trace: follow_through must be in (0, 1], got {cfg.follow_through}")
    if cfg.dram_ttl_s < 0 or cfg.cache_pressure < 0:
        raise UserError("bench serve trace: dram_ttl_s and cache_pressure must be >= 0")


@dataclass
class _Stream:
    """What selecting a point's visits reads from the population (computed once per trace)."""

    user_of: np.ndarray
    sess_id: np.ndarray
    sess_first_idx: np.ndarray
    in_win: np.ndarray  # sessions (by first event) that start inside the window
    sessions: np.ndarray  # [U] sessions each user has in the window
    per_session: float  # expected visits of a visited session
    t0: int
    win_starts: np.ndarray  # [U] each user's first event at or after t0 (global index)


def _stream(pop: Population, cfg: TraceConfig, needed: int) -> _Stream:
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
    win_starts = pop.offsets[:-1] + np.bincount(user_of[pop.ts < t0], minlength=n_users)
    return _Stream(user_of, sess_id, sess_first_idx, in_win, sessions, per_session, t0, win_starts)


def _select(pop: Population, cfg: TraceConfig, st: _Stream, needed: int, cap: int, session_cap: int,
            rng: np.random.Generator) -> np.ndarray:
    """Candidate visits (event indices, stream order): Zipf-weighted sessions, bursts inside them, at most
    ``cap`` visits and ``session_cap`` sessions per user; at least ``needed`` unless the population runs out."""
    z = zipf_weights(np.diff(pop.offsets).astype(np.float64), cfg.zipf)
    firsts = st.sess_first_idx[st.in_win]
    p = _session_probs(z, st.sessions, st.per_session, int(needed * 1.15))
    while True:
        chosen_sess = firsts[rng.random(len(firsts)) < p[st.user_of[firsts]]]
        chosen = np.zeros(len(pop.ts), dtype=bool)
        chosen[chosen_sess] = True
        # later events of a chosen session: same session id as a chosen first event
        sess_chosen = np.zeros(int(st.sess_id[-1]) + 1, dtype=bool)
        sess_chosen[st.sess_id[chosen_sess]] = True
        later = sess_chosen[st.sess_id] & ~pop.session_first & (rng.random(len(pop.ts)) < cfg.burst_prob)
        idx = np.flatnonzero(chosen | later)
        idx = _cap_sessions(idx[np.argsort(pop.ts[idx], kind="stable")], st.user_of, st.sess_id, session_cap)
        idx = _cap_per_user(idx, st.user_of, pop.ts, cap)
        if len(idx) >= needed or np.all(p[st.sessions > 0] >= 1.0):
            return idx
        p = np.minimum(1.0, p * 1.5)


def _long_lens(st: _Stream, base: np.ndarray, events: np.ndarray) -> np.ndarray:
    """The long-term length at each visit: the user's base, then her window events before the session."""
    u = st.user_of[events]
    s_first = st.sess_first_idx[st.sess_id[events]]
    return base[u] + (s_first - st.win_starts[u])


def working_set_bytes(users: np.ndarray, long_lens: np.ndarray, kv_bytes_per_token: int) -> int:
    """Bytes the visited users' prefixes need at once: each user's longest prefix, summed."""
    longest: dict[int, int] = {}
    for u, n in zip(users.tolist(), long_lens.tolist(), strict=True):
        longest[u] = max(longest.get(u, 0), n)
    return int(sum(longest.values()) * kv_bytes_per_token)


def max_long_bound(pop: Population, cfg: TraceConfig) -> int:
    """An upper bound on any visit's long-term length in a trace of ``cfg`` at any QPS: the longest base plus
    the most events any user has in the window (what a model's max_len must cover)."""
    st = _stream(pop, cfg, signals_needed(cfg))
    firsts = st.sess_first_idx[st.in_win]
    end = int(pop.ts[firsts].max()) if len(firsts) else st.t0
    in_window = (pop.ts >= st.t0) & (pop.ts <= end)
    growth = np.bincount(st.user_of[in_window], minlength=len(pop.offsets) - 1)
    return int((base_lengths(pop, cfg) + growth).max())


def build_trace(pop: Population, cfg: TraceConfig) -> Trace:
    """The visits of one point, in send order: ``cfg.warmup`` of them, then enough for ``cfg.measured`` ranks."""
    from grstack.runtime.errors import UserError

    _check(cfg)
    rng = np.random.default_rng([cfg.seed, 7])  # which visits: the same at every length (at one pressure_length)
    fill = np.random.default_rng([cfg.seed, cfg.length, 11])  # base histories and candidates
    needed = signals_needed(cfg)
    n_users = len(pop.offsets) - 1
    st = _stream(pop, cfg, needed)
    base = base_lengths(pop, cfg)
    # One user cannot ask for rankings faster than every min_user_gap_s: a point lasting needed/qps seconds
    # holds at most this many of a user's visits (a higher QPS comes from more users, not faster ones).
    # (half of it: a heavy user must share the arrivals with everyone else and still fit in the point)
    span = needed / cfg.qps
    cap = max(1, int(0.5 * span / cfg.min_user_gap_s) + 1) if cfg.min_user_gap_s > 0 else needed
    # and her sessions at least dram_ttl_s apart: at most this many of them fit in the point
    apart = cfg.dram_ttl_s if cfg.keep_sessions_apart else 0.0
    session_cap = 1 + int(span / apart) if apart > 0 else needed
    sized = cfg.kv_bytes_per_token > 0 and cfg.device_cache_bytes > 0
    # sized at one length for every point of a sweep, so that a sweep's points replay the same visits
    size_base = base_lengths(pop, replace(cfg, length=cfg.pressure_length or cfg.length))
    best: tuple[np.ndarray, np.ndarray] | None = None
    got = 0
    while True:
        idx = _select(pop, cfg, st, needed, cap, session_cap, rng)
        order, wall = _schedule(idx, st.user_of, st.sess_id, cfg.qps, cfg.min_user_gap_s,
                                apart, np.random.default_rng([cfg.seed, 13]))
        got = len(order)
        if got < needed:  # the population runs out: keep the last cap that filled the point
            break
        best = order[:needed], wall[:needed]
        if not sized or cap == 1 or working_set_bytes(
                st.user_of[best[0]], _long_lens(st, size_base, best[0]),
                cfg.kv_bytes_per_token) >= cfg.cache_pressure * cfg.device_cache_bytes:
            break
        cap = max(1, cap // 2)  # more users, fewer visits each
    if best is None:
        raise UserError(f"bench serve: {n_users} users give only {got} visits; need {needed} "
                        f"(more --users, or fewer --measured/--warmup)")
    order, wall = best
    t_vis = pop.ts[order]
    gaps = cfg.gap_ms / 1e3 * fill.uniform(1 - cfg.jitter, 1 + cfg.jitter, needed)
    follows = np.random.default_rng([cfg.seed, 17]).random(needed) < cfg.follow_through
    ranked_after = np.cumsum(follows & (np.arange(needed) >= cfg.warmup))
    if ranked_after[-1] < cfg.measured:
        raise UserError(f"bench serve trace: {needed} signals gave {ranked_after[-1]} ranks; need {cfg.measured}")
    keep = int(np.searchsorted(ranked_after, cfg.measured)) + 1  # the visit of the last measured rank
    trace = Trace(cfg, num_items=pop.num_items)
    histories: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    last_len: dict[int, int] = {}
    for k, e in enumerate(order[:keep]):
        u = int(st.user_of[e])
        if u not in histories:
            n = int(base[u])
            histories[u] = (fill.integers(1, pop.num_items + 1, n),
                            st.t0 - 1 - np.cumsum(fill.integers(30, 3600, n))[::-1])
        s_first = int(st.sess_first_idx[st.sess_id[e]])
        win_lo = int(st.win_starts[u])
        long_items = np.concatenate([histories[u][0], pop.items[win_lo:s_first]])
        long_ts = np.concatenate([histories[u][1], pop.ts[win_lo:s_first]])
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
                                  session=int(st.sess_id[e]), grew=None if prev is None else len(long_items) > prev,
                                  ranked=bool(follows[k])))
    trace.shape = trace_shape(trace, n_users, float(t_vis[:keep].max() - t_vis[:keep].min()) / 3600.0)
    return trace


def reuse_flags(trace: Trace) -> list[bool]:
    """Per visit: a repeat visit of a user whose last ranked visit was less than the DRAM TTL earlier, so
    that a rank's prefix could still be cached for it (capacity permitting) without any pre-inference."""
    last: dict[int, float] = {}
    out = []
    for v in trace.visits:
        prev = last.get(v.user)
        out.append(prev is not None and v.wall_s - prev < trace.config.dram_ttl_s)
        if v.ranked:
            last[v.user] = v.rank_s
    return out


def trace_shape(trace: Trace, population_users: int, span_h: float) -> dict[str, float | int | str | None]:
    """What the JSON reports about a trace: who visits, how often, how long their histories are and how they
    grow, how many signals are followed, how much of it reuse alone could serve and the cache pressure."""
    cfg = trace.config
    users = np.array([v.user for v in trace.visits])
    _, per_user = np.unique(users, return_counts=True)
    top = max(1, int(np.ceil(0.01 * population_users)))  # of the population: users without visits count
    sessions: dict[int, set[int]] = {}
    longest: dict[int, int] = {}
    for v in trace.visits:
        sessions.setdefault(v.user, set()).add(v.session)
        longest[v.user] = max(longest.get(v.user, 0), len(v.long_items))
    repeat = [v.grew for v in trace.visits if v.grew is not None]
    q = np.quantile(per_user, [0.5, 0.9, 0.99, 1.0]) if len(per_user) else [0, 0, 0, 0]
    lq = np.quantile(list(longest.values()), [0.5, 0.9, 0.99]) if longest else [0, 0, 0]
    last: dict[int, tuple[float, int]] = {}
    gaps, session_gaps = [], []
    for v in trace.visits:
        if v.user in last:
            gap = v.wall_s - last[v.user][0]
            gaps.append(gap)
            if v.session != last[v.user][1]:
                session_gaps.append(gap)
        last[v.user] = (v.wall_s, v.session)
    walls = [v.wall_s for v in trace.visits]
    measured = [v for k, v in enumerate(trace.visits) if k >= cfg.warmup and v.ranked]
    reuse = [r for k, (v, r) in enumerate(zip(trace.visits, reuse_flags(trace), strict=True))
             if k >= cfg.warmup and v.ranked]
    ws = int(sum(longest.values()) * cfg.kv_bytes_per_token)
    sized = cfg.kv_bytes_per_token > 0 and cfg.device_cache_bytes > 0
    return {"population_users": population_users, "users": len(per_user), "visits": len(trace.visits),
            "ranked": sum(v.ranked for v in trace.visits), "measured": len(measured),
            "visits_per_user_p50": float(q[0]), "visits_per_user_p90": float(q[1]),
            "visits_per_user_p99": float(q[2]), "visits_per_user_max": float(q[3]),
            "top1pct_population_visit_share": float(np.sort(per_user)[::-1][:top].sum() / max(1, len(users))),
            "sessions_per_user_mean": float(np.mean([len(s) for s in sessions.values()])) if sessions else 0.0,
            "length_dist": cfg.length_dist,
            "mean_long_term_len": float(np.mean([len(v.long_items) for v in trace.visits])),
            "user_long_term_len_p50": float(lq[0]), "user_long_term_len_p90": float(lq[1]),
            "user_long_term_len_p99": float(lq[2]), "max_long_term_len": trace.max_long,
            "repeat_visit_fraction": len(repeat) / max(1, len(trace.visits)),
            "prefix_grew_fraction": (sum(repeat) / len(repeat)) if repeat else None,
            "follow_through": cfg.follow_through,
            "ranked_fraction": sum(v.ranked for v in trace.visits) / max(1, len(trace.visits)),
            "reuse_share": (sum(reuse) / len(reuse)) if reuse else None,
            "dram_ttl_s": cfg.dram_ttl_s,
            "session_gap_wall_s_min": float(min(session_gaps)) if session_gaps else None,
            "kv_bytes_per_token": cfg.kv_bytes_per_token, "device_cache_bytes": cfg.device_cache_bytes,
            "working_set_bytes": ws if cfg.kv_bytes_per_token > 0 else None,
            "cache_pressure": ws / cfg.device_cache_bytes if sized else None,
            "cache_pressure_target": cfg.cache_pressure if sized else None,
            "stream_span_h": span_h, "wall_span_s": (max(walls) - min(walls)) if walls else 0.0,
            "user_gap_wall_s_p50": float(np.median(gaps)) if gaps else None,
            "user_gap_wall_s_min": float(min(gaps)) if gaps else None}

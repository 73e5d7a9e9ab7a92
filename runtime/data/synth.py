"""Synthetic KuaiRand-27K-like data: ``synthesize(preset, seed, **overrides)``.

The generative story, chosen so a sequential model has more to learn than popularity:

* Items belong to topics laid out on a ring (neighbouring topics are related); inside a topic, popularity
  is Zipf over the topic's items, and topics themselves have Zipf popularity. Item ids are a random
  permutation, so ids carry no structure.
* Every user has 1..``centers_max`` interest centres on the topic ring. The centres random-walk (drift) from
  one topic run to the next, so early and late interests differ.
* A sequence is a series of sessions (seconds to minutes between events, hours to days between sessions,
  heavier users come back sooner); inside a session the user stays on one topic for a run of events and
  switches with ``switch_prob``. A run is on a topic near one of the user's centres, or, with
  ``explore_prob``, on a topic drawn from global topic popularity.
* Inside a run the next item continues a chain through the topic (one to three steps along the topic's
  item order) with ``chain_prob``, else it is a fresh Zipf draw from the topic; so the next item depends
  strongly on the last few.
* Labels (``click``, ``like``, ``long_view``; the same bits as the KuaiRand importer) grow with how well
  the run's topic matches the user's interests and with a per-item quality. With ``taste_sigma`` (the
  ``hard-rank`` preset) they also follow a taste the visits do not show, as engagement on a platform's
  impressions does: each user's own smooth function of the topic ring (three random low-frequency
  components, std ``taste_sigma`` in logits) plus one per ``age_range`` group (std ``group_taste_sigma``);
  only the user's past actions (and age) reveal it. Drawn from a generator of their own, so the events and
  every other preset's labels do not change.
* Side features, KuaiRand-like (drawn last, from their own generator, so the events do not change): items
  have a ``tag`` (their topic; a random one for 15% of items, as tags are noisy) and an ``author`` (one of
  about four per topic); users have ``activity`` (a quartile of their length, KuaiRand's active degree), a
  ``region`` (the tenth of the topic ring their strongest initial interest lies in; a random one for 30% of
  users) and an uninformative ``age_range``.

Everything is vectorised over events (no per-user Python loop) and drawn from one ``numpy`` generator in a
fixed order, so the same seed gives byte-identical arrays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.features import FeatureField, Features
from grstack.runtime.errors import UserError

ACTION_NAMES = ["click", "like", "long_view"]
DAY = 86_400


@dataclass(frozen=True)
class SynthConfig:
    num_users: int
    num_items: int
    num_topics: int
    len_median: float  # sequence lengths are lognormal(log(len_median), len_sigma), clipped
    len_sigma: float
    min_len: int
    max_len: int
    item_zipf: float = 1.1  # popularity exponent of items inside a topic
    topic_zipf: float = 0.9  # popularity exponent of topics
    centers_max: int = 3  # interest centres per user: 1..centers_max
    interest_width: float = 1.0  # spread (in topics) of a run's topic around its centre
    drift: float = 0.4  # std (in topics) of a centre's random-walk step per topic run
    switch_prob: float = 0.12  # per event: switch topic inside a session
    chain_prob: float = 0.65  # per event: the next item follows the current one in the topic's order
    explore_prob: float = 0.1  # a run on a globally popular topic instead of the user's interests
    session_mean: float = 12.0  # mean events per session
    within_gap_s: float = 25.0  # median gap inside a session
    span_days: float = 30.0  # heavier users' sessions are packed into about this span
    taste_sigma: float = 0.0  # std (logits) of a user's hidden taste over the topic ring (module doc)
    group_taste_sigma: float = 0.0  # std (logits) of each age_range group's taste over the topic ring
    start_time: int = 1_649_376_000  # 2022-04-08 00:00:00 UTC, the start of KuaiRand's logs

    def check(self) -> None:
        if self.num_users < 1 or self.num_items < 2 * self.num_topics or self.num_topics < 1:
            raise UserError("synth: need num_users >= 1, num_topics >= 1 and num_items >= 2 * num_topics")
        if not 1 <= self.min_len <= self.max_len:
            raise UserError(f"synth: need 1 <= min_len <= max_len, got {self.min_len} and {self.max_len}")
        for name in ("switch_prob", "chain_prob", "explore_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UserError(f"synth: {name} must lie in [0, 1], got {getattr(self, name)}")
        if self.session_mean < 1 or self.centers_max < 1:
            raise UserError("synth: session_mean and centers_max must be at least 1")
        if self.taste_sigma < 0 or self.group_taste_sigma < 0:
            raise UserError("synth: taste_sigma and group_taste_sigma must be >= 0")


PRESETS: dict[str, SynthConfig] = {
    # CI: ~400 users, ~25k events; a sequential model beats popularity after a few seconds of training.
    "tiny": SynthConfig(num_users=400, num_items=800, num_topics=24, len_median=45, len_sigma=0.7,
                        min_len=10, max_len=200, session_mean=10.0),
    "small": SynthConfig(num_users=3000, num_items=6000, num_topics=80, len_median=150, len_sigma=0.9,
                         min_len=20, max_len=1000),
    # As hard as KuaiRand-27K for next-item retrieval (docs/synthetic.md): no item chains, wide and drifting
    # interests, half the runs off-interest, flat popularity over many items per topic. Calibrated on HSTU
    # (configs/synthetic-hard-hstu.yaml): test HR@10 0.045 (TurboGR reports about 0.03 on KuaiRand-27K;
    # the small preset gives 0.75).
    "hard": SynthConfig(num_users=3000, num_items=40_000, num_topics=200, len_median=120, len_sigma=0.9,
                        min_len=20, max_len=1000, item_zipf=0.5, topic_zipf=0.6, interest_width=6.0, drift=2.0,
                        switch_prob=0.5, chain_prob=0.0, explore_prob=0.6),
    # The hard preset's events with labels that also follow a taste only actions and age reveal (module doc):
    # the data the ranking comparison of actions and user context as inputs runs on (docs/features.md).
    "hard-rank": SynthConfig(num_users=3000, num_items=40_000, num_topics=200, len_median=120, len_sigma=0.9,
                             min_len=20, max_len=1000, item_zipf=0.5, topic_zipf=0.6, interest_width=6.0,
                             drift=2.0, switch_prob=0.5, chain_prob=0.0, explore_prob=0.6, taste_sigma=1.0,
                             group_taste_sigma=0.5),
    # KuaiRand-27K's user count; lengths from 100 to 10k with a heavy tail.
    "27k": SynthConfig(num_users=27_285, num_items=40_000, num_topics=400, len_median=450, len_sigma=1.0,
                       min_len=100, max_len=10_000),
}


def resolve(preset: str, overrides: dict) -> SynthConfig:
    if preset not in PRESETS:
        raise UserError(f"unknown synth preset {preset!r} (known: {', '.join(PRESETS)})")
    names = {f.name: f.type for f in dataclasses.fields(SynthConfig)}
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise UserError(f"synth: unknown setting(s) {', '.join(unknown)} (settings: {', '.join(names)})")
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    cfg.check()
    return cfg


def _segmented_cumsum(x: np.ndarray, seg_first: np.ndarray, seg_of: np.ndarray) -> np.ndarray:
    """Inclusive cumsum of ``x`` restarting at every segment; the first element of a segment keeps x."""
    cs = np.cumsum(x, axis=0)
    return cs - cs[seg_first][seg_of] + x[seg_first][seg_of]


@dataclass
class _Catalogue:
    topic_start: np.ndarray  # [K] first slot of each topic
    topic_size: np.ndarray  # [K]
    topic_pop: np.ndarray  # [K] probabilities
    keys: np.ndarray  # [N] topic + within-topic popularity CDF, increasing; for one searchsorted
    item_of_slot: np.ndarray  # [N] dense item id (1..N) of each (topic, rank) slot
    quality: np.ndarray  # [N + 1] per item id


def _catalogue(cfg: SynthConfig, rng: np.random.Generator) -> _Catalogue:
    k, n = cfg.num_topics, cfg.num_items
    weights = rng.lognormal(0.0, 0.5, k)
    size = rng.multinomial(n - 2 * k, weights / weights.sum()).astype(np.int64) + 2
    start = np.zeros(k, dtype=np.int64)
    np.cumsum(size[:-1], out=start[1:])
    topic_of_slot = np.repeat(np.arange(k), size)
    rank = np.arange(n) - start[topic_of_slot]
    w = (rank + 1.0) ** -cfg.item_zipf
    cum = _segmented_cumsum(w, start, topic_of_slot)
    cum = cum / cum[start + size - 1][topic_of_slot]
    cum[start + size - 1] = 1.0
    pop = (np.arange(k) + 1.0) ** -cfg.topic_zipf
    topic_pop = np.empty(k)
    topic_pop[rng.permutation(k)] = pop / pop.sum()
    return _Catalogue(
        topic_start=start,
        topic_size=size,
        topic_pop=topic_pop,
        keys=topic_of_slot + cum,
        item_of_slot=rng.permutation(n).astype(np.int64) + 1,
        quality=np.concatenate([[0.0], rng.normal(0.0, 0.5, n)]),
    )


def _ring_dist(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    d = np.abs(a - b) % k
    return np.minimum(d, k - d)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def synthesize(preset: str, seed: int = 0, **overrides: object) -> SequenceDataset:
    """A KuaiRand-27K-like dataset (see the module doc); ``overrides`` replace ``SynthConfig`` fields."""
    cfg = resolve(preset, overrides)
    rng = np.random.default_rng(seed)
    cat = _catalogue(cfg, rng)
    k, u_count = cfg.num_topics, cfg.num_users

    # Users: lengths, interest centres and their weights, how soon they come back.
    lengths = np.clip(np.rint(rng.lognormal(np.log(cfg.len_median), cfg.len_sigma, u_count)),
                      cfg.min_len, cfg.max_len).astype(np.int64)
    offsets = np.zeros(u_count + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_events = int(offsets[-1])
    first = offsets[:-1]
    c_max = cfg.centers_max
    n_centres = rng.integers(1, c_max + 1, u_count)
    active = np.arange(c_max)[None, :] < n_centres[:, None]
    centre0 = rng.choice(k, size=(u_count, c_max), p=cat.topic_pop) + rng.random((u_count, c_max))
    wts = rng.gamma(1.0, 1.0, (u_count, c_max)) * active
    cum_w = np.cumsum(wts / wts.sum(1, keepdims=True), axis=1)
    sessions_per_user = np.maximum(1.0, lengths / cfg.session_mean)
    session_gap_median = np.clip(cfg.span_days * DAY / sessions_per_user, 1800.0, 3.0 * DAY)
    user_start = cfg.start_time + rng.integers(0, 7 * DAY, u_count)

    # Events -> sessions -> topic runs.
    user_of = np.repeat(np.arange(u_count), lengths)
    new_session = rng.random(n_events) < 1.0 / cfg.session_mean
    new_session[first] = True
    new_run = new_session | (rng.random(n_events) < cfg.switch_prob)
    run_of = np.cumsum(new_run) - 1
    run_first = np.flatnonzero(new_run)
    n_runs = len(run_first)
    run_user = user_of[run_first]
    user_first_run = run_of[first]

    # Interest centres drift by a random walk over runs; each run picks one centre (or explores).
    steps = rng.normal(0.0, cfg.drift, (n_runs, c_max))
    steps[user_first_run] = 0.0
    centre = centre0[run_user] + _segmented_cumsum(steps, user_first_run, run_user)
    del steps
    pick = np.minimum((rng.random(n_runs)[:, None] > cum_w[run_user]).sum(1), n_centres[run_user] - 1)
    near = centre[np.arange(n_runs), pick] + rng.normal(0.0, cfg.interest_width, n_runs)
    explore = rng.random(n_runs) < cfg.explore_prob
    run_topic = np.where(explore, rng.choice(k, size=n_runs, p=cat.topic_pop),
                         np.floor(near).astype(np.int64) % k)
    dist = _ring_dist(run_topic[:, None] + 0.5, centre, k)
    dist[~active[run_user]] = np.inf
    run_match = np.exp(-0.5 * (dist.min(1) / cfg.interest_width) ** 2)
    del centre, dist

    # Items: chains through the topic's item order, restarted by a fresh Zipf draw.
    topic = run_topic[run_of]
    restart = new_run | (rng.random(n_events) >= cfg.chain_prob)
    chain_of = np.cumsum(restart) - 1
    chain_first = np.flatnonzero(restart)
    ct = topic[chain_first]
    slot = np.searchsorted(cat.keys, ct + rng.random(len(chain_first)), side="right")
    fresh_rank = np.minimum(slot, cat.topic_start[ct] + cat.topic_size[ct] - 1) - cat.topic_start[ct]
    step = np.searchsorted(np.array([0.6, 0.9]), rng.random(n_events), side="right") + 1  # 1, 2 or 3
    step[chain_first] = 0
    walked = _segmented_cumsum(step, chain_first, chain_of)
    rank = (fresh_rank[chain_of] + walked) % cat.topic_size[topic]
    items = cat.item_of_slot[cat.topic_start[topic] + rank]
    del walked, step, rank, chain_of

    # Time: short gaps inside a session, long ones between sessions.
    gaps = np.clip(rng.lognormal(np.log(cfg.within_gap_s), 0.9, n_events), 1.0, 900.0)
    sess = np.flatnonzero(new_session)
    gaps[sess] = np.clip(rng.lognormal(np.log(session_gap_median[user_of[sess]]), 0.8), 600.0, 10.0 * DAY)
    gaps = np.rint(gaps).astype(np.int64)
    gaps[first] = 0
    timestamps = user_start[user_of] + _segmented_cumsum(gaps, first, user_of)
    del gaps

    strongest = centre0[np.arange(u_count), np.argmax(wts, axis=1)]
    item_feats, user_feats, age = _side_features(cfg, cat, lengths, strongest, seed)

    # Labels grow with the interest match of the run, the item's quality and the hidden taste (module doc).
    match = run_match[run_of]
    quality = cat.quality[items]
    taste = _taste(cfg, age, seed)
    pref = taste[user_of, topic] if taste is not None else 0.0
    del taste
    click = rng.random(n_events) < _sigmoid(-1.0 + 2.2 * match + quality + pref)
    like = click & (rng.random(n_events) < _sigmoid(-3.6 + 2.0 * match + quality + pref))
    long_view = rng.random(n_events) < _sigmoid(-1.8 + 2.4 * match + 0.6 * quality + pref)
    actions = click.astype(np.int64) | (like.astype(np.int64) << 1) | (long_view.astype(np.int64) << 2)
    ds = SequenceDataset(
        user_ids=np.arange(1, u_count + 1, dtype=np.int64),
        offsets=offsets,
        item_ids=items,
        timestamps=timestamps,
        num_items=cfg.num_items,
        actions=actions,
        action_names=list(ACTION_NAMES),
        name=f"synthetic-{preset}",
        source=f"synth:{preset}:seed={seed}",
        info={"generator": "grstack.runtime.data.synth", "preset": preset, "seed": seed,
              "config": dataclasses.asdict(cfg)},
        item_features=item_feats,
        user_features=user_feats,
    )
    ds.validate()
    return ds


def _single(name: str, values: np.ndarray, prefix: str) -> FeatureField:
    """A one-value-per-row field from integer codes (vocab tokens ``prefix<code>``)."""
    codes, dense = np.unique(values, return_inverse=True)
    return FeatureField(name, np.arange(len(values) + 1, dtype=np.int64), dense.astype(np.int64) + 1,
                        np.array([f"{prefix}{c}" for c in codes]))


def _ring_functions(rng: np.random.Generator, rows: int, k: int, sigma: float) -> np.ndarray:
    """[rows, k] smooth random functions of the topic ring: three low-frequency components, std ``sigma``."""
    angle = 2.0 * np.pi * np.arange(k) / k
    out = np.zeros((rows, k))
    for f in (1, 2, 3):
        a, b = rng.normal(0.0, 1.0, (2, rows, 1))
        out += a * np.cos(f * angle)[None, :] + b * np.sin(f * angle)[None, :]
    return out * (sigma / np.sqrt(3.0))


def _taste(cfg: SynthConfig, age: np.ndarray, seed: int) -> np.ndarray | None:
    """[users, topics] hidden taste in logits: each user's own ring function plus their age group's."""
    if cfg.taste_sigma == 0 and cfg.group_taste_sigma == 0:
        return None
    rng = np.random.default_rng([seed, 0x7A57E])
    k = cfg.num_topics
    group = _ring_functions(rng, int(age.max()) + 1, k, cfg.group_taste_sigma)
    return _ring_functions(rng, len(age), k, cfg.taste_sigma) + group[age]


def _side_features(cfg: SynthConfig, cat: _Catalogue, lengths: np.ndarray, strongest: np.ndarray,
                   seed: int) -> tuple[Features, Features, np.ndarray]:
    """Item and user side features (module doc), from a generator of their own, and each user's age group."""
    rng = np.random.default_rng([seed, 0x5EA7])
    k, n = cfg.num_topics, cfg.num_items
    topic_of_item = np.empty(n, dtype=np.int64)
    topic_of_item[cat.item_of_slot - 1] = np.repeat(np.arange(k), cat.topic_size)
    tag = np.where(rng.random(n) < 0.15, rng.integers(0, k, n), topic_of_item)
    author = topic_of_item * 4 + rng.integers(0, 4, n)
    items = Features("item", n, [_single("tag", tag, "t"), _single("author", author, "a")])
    u = len(lengths)
    activity = np.searchsorted(np.quantile(lengths, [0.25, 0.5, 0.75]), lengths, side="right")
    region = np.where(rng.random(u) < 0.3, rng.integers(0, 10, u), (np.floor(strongest) * 10 // k).astype(np.int64))
    age = rng.integers(0, 7, u)
    users = Features("user", u, [_single("activity", activity, "q"), _single("region", region, "r"),
                                 _single("age_range", age, "age")])
    return items, users, age

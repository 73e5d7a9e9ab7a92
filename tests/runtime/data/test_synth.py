"""The synthetic generator: determinism, and the statistics its presets promise."""

from __future__ import annotations

import numpy as np
import pytest

from grstack.runtime.data.dataset import read_dataset, write_dataset
from grstack.runtime.data.stats import dataset_stats
from grstack.runtime.data.synth import PRESETS, synthesize
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny():
    return synthesize("tiny", seed=0)


def test_same_seed_same_bytes_other_seed_differs() -> None:
    a, b, c = synthesize("tiny", seed=3), synthesize("tiny", seed=3), synthesize("tiny", seed=4)
    for f in ("user_ids", "offsets", "item_ids", "timestamps", "actions"):
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes(), f
    assert a.item_ids.tobytes() != c.item_ids.tobytes()
    assert a.info == b.info and a.info["seed"] == 3


def test_tiny_shape_and_heavy_tailed_lengths(tiny) -> None:
    cfg = PRESETS["tiny"]
    assert tiny.num_users == cfg.num_users and tiny.num_items == cfg.num_items
    lengths = tiny.lengths
    assert lengths.min() >= cfg.min_len and lengths.max() <= cfg.max_len
    assert lengths.mean() > 1.15 * np.median(lengths)  # right-skewed
    assert np.percentile(lengths, 99) > 3 * np.median(lengths)
    assert tiny.item_ids.min() >= 1 and tiny.item_ids.max() <= tiny.num_items


def test_zipf_like_popularity(tiny) -> None:
    pop = dataset_stats(tiny)["popularity"]
    assert pop["top1pct_share"] > 0.05  # uniform popularity would give 0.01
    assert pop["top10pct_share"] > 0.35
    assert 0.5 < pop["zipf_exponent"] < 2.0


def test_sessions_give_short_and_long_gaps(tiny) -> None:
    t = dataset_stats(tiny)["time"]
    assert t["first"] >= PRESETS["tiny"].start_time  # realistic epoch seconds (2022)
    assert t["gap_p50_s"] < 120  # inside a session: seconds to minutes
    assert t["gap_p90_s"] > 3600  # between sessions: hours to days
    assert 7 < t["span_days"] < 365


def _far_and_near_overlap(ds, w: int = 10) -> tuple[float, float]:
    """Mean Jaccard overlap of a user's first w items with the last w (far) and with the next w (near)."""
    far, near = [], []
    for k in range(ds.num_users):
        s = ds.sequence(k)
        if len(s) >= 6 * w:
            first = set(s[:w].tolist())
            for out, other in ((far, s[-w:]), (near, s[w : 2 * w])):
                other = set(other.tolist())
                out.append(len(first & other) / len(first | other))
    return float(np.mean(far)), float(np.mean(near))


def test_interests_drift() -> None:
    kw = {"num_users": 200, "len_median": 120}
    far, near = _far_and_near_overlap(synthesize("tiny", seed=1, **kw))
    far_static, _ = _far_and_near_overlap(synthesize("tiny", seed=1, drift=0.0, **kw))
    assert far < near
    assert far < 0.85 * far_static  # the same draws without drift keep early interests


def _hit_rate_at_10(ds) -> tuple[float, float]:
    """Leave-one-out HR@10 of popularity and of "what followed the previous item most often"."""
    last = ds.offsets[1:] - 1
    train = np.ones(ds.num_events, dtype=bool)
    train[last] = False
    pop = np.bincount(ds.item_ids[train], minlength=ds.num_items + 1)
    pop[0] = -1
    top = np.argsort(-pop, kind="stable")[:10]
    target, prev = ds.item_ids[last], ds.item_ids[last - 1]
    a, b = ds.item_ids[:-1], ds.item_ids[1:]
    ok = train[1:].copy()
    ok[ds.offsets[1:-1] - 1] = False  # no pairs across users
    counts = np.zeros((ds.num_items + 1, ds.num_items + 1), dtype=np.int32)
    np.add.at(counts, (a[ok], b[ok]), 1)
    hits = 0
    for p, t in zip(prev, target, strict=True):
        ranked = np.argsort(-counts[p], kind="stable")[:10]
        hits += t in ranked[counts[p][ranked] > 0] or (counts[p].sum() == 0 and t in top)
    return float(np.isin(target, top).mean()), hits / len(target)


def test_next_item_depends_on_recent_items(tiny) -> None:
    popularity, bigram = _hit_rate_at_10(tiny)
    assert bigram > 2 * popularity
    assert bigram > 0.3


def test_labels_follow_interest_match() -> None:
    kw = {"num_users": 150}
    focused = synthesize("tiny", seed=2, explore_prob=0.0, **kw)
    exploring = synthesize("tiny", seed=2, explore_prob=1.0, **kw)
    assert focused.action_names == ["click", "like", "long_view"]
    for bit in range(3):
        rate_focused = float(((focused.actions >> bit) & 1).mean())
        rate_exploring = float(((exploring.actions >> bit) & 1).mean())
        assert rate_focused > 1.4 * rate_exploring, focused.action_names[bit]


def test_27k_preset_scaled_down() -> None:
    ds = synthesize("27k", seed=0, num_users=60)
    cfg = PRESETS["27k"]
    assert cfg.num_users == 27_285 and cfg.max_len == 10_000
    assert ds.num_users == 60 and ds.num_items == cfg.num_items
    assert ds.lengths.min() >= 100 and ds.lengths.max() <= 10_000
    assert ds.lengths.mean() > 400


def test_bad_preset_and_override() -> None:
    with pytest.raises(UserError, match="unknown synth preset 'huge'"):
        synthesize("huge")
    with pytest.raises(UserError, match="unknown setting"):
        synthesize("tiny", users=5)
    with pytest.raises(UserError, match="min_len <= max_len"):
        synthesize("tiny", min_len=50, max_len=10)


def test_round_trip(tiny, tmp_path) -> None:
    back = read_dataset(write_dataset(tiny, tmp_path / "syn", rows_per_file=150))
    assert len(list((tmp_path / "syn").glob("part-*.parquet"))) == 3
    for f in ("user_ids", "offsets", "item_ids", "timestamps", "actions"):
        assert np.array_equal(getattr(tiny, f), getattr(back, f)), f
    assert back.action_names == tiny.action_names and back.item_raw_ids is None
    assert back.info["preset"] == "tiny"


def test_shipped_configs_validate_and_name_known_presets():
    """Every config under configs/ loads; the synthetic ones name a preset that exists."""
    from pathlib import Path

    from grstack.runtime.training_config import load_config

    configs = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
    assert any(p.name == "synthetic-hard-hstu.yaml" for p in configs)
    for path in configs:
        cfg = load_config(path)
        if cfg.data.format == "synth":
            assert cfg.data.source in PRESETS, path.name



def test_side_features_are_kuairand_like_and_leave_the_events_alone(tiny, monkeypatch) -> None:
    """Items carry a topic tag and an author, users an activity quartile, a region and an age range; they come
    from a generator of their own, so the events are those of a preset without them."""
    items, users = tiny.item_features, tiny.user_features
    assert items.names == ["tag", "author"] and users.names == ["activity", "region", "age_range"]
    assert items.num_rows == tiny.num_items and users.num_rows == tiny.num_users
    assert all(np.array_equal(np.diff(f.offsets), np.ones(f.offsets.size - 1)) for f in items.fields + users.fields)
    assert items.sizes["tag"] == 24 and items.sizes["author"] <= 4 * 24 and users.sizes["activity"] == 4
    # activity is the quartile of the user's length: longer users never sit in a lower quartile
    act = users.fields[0].vocab[users.fields[0].values - 1]
    order = np.argsort(tiny.lengths, kind="stable")
    assert (np.diff(np.array([int(a[1:]) for a in act])[order]) >= 0).all()
    # most items' tag is their author's topic (authors are four per topic)
    tag = np.array([int(t[1:]) for t in items.fields[0].vocab[items.fields[0].values - 1]])
    author = np.array([int(a[1:]) for a in items.fields[1].vocab[items.fields[1].values - 1]])
    assert 0.75 < np.mean(tag == author // 4) < 0.95
    again = synthesize("tiny", seed=0)
    assert np.array_equal(again.user_features.fields[1].values, users.fields[1].values)
    from grstack.runtime.data import synth
    from grstack.runtime.data.features import Features

    monkeypatch.setattr(synth, "_side_features", lambda cfg, cat, lengths, strongest, seed: (
        Features("item", cfg.num_items), Features("user", len(lengths)), np.zeros(len(lengths), np.int64)))
    bare = synthesize("tiny", seed=0)
    for f in ("offsets", "item_ids", "timestamps", "actions"):
        assert getattr(bare, f).tobytes() == getattr(tiny, f).tobytes(), f


def _half_consistency(ds) -> float:
    """Correlation, over (user, tag) pairs seen in both halves of a user's sequence, of the pair's click rate in
    the first half with that in the second: how much a user's own past clicks on a topic say about later ones."""
    tag = ds.item_features.fields[0].values  # row i: item i + 1 (single-valued)
    first, second = [], []
    for u in range(ds.num_users):
        lo, hi = int(ds.offsets[u]), int(ds.offsets[u + 1])
        mid = (lo + hi) // 2
        t = tag[ds.item_ids[lo:hi] - 1]
        c = (ds.actions[lo:hi] & 1).astype(float)
        for v in np.unique(t):
            a, b = c[: mid - lo][t[: mid - lo] == v], c[mid - lo :][t[mid - lo :] == v]
            if len(a) >= 2 and len(b) >= 2:
                first.append(a.mean())
                second.append(b.mean())
    return float(np.corrcoef(first, second)[0, 1])


def test_a_hidden_taste_changes_the_labels_only_and_past_clicks_reveal_it() -> None:
    """hard-rank is the hard preset's events with labels that also follow a per-user taste over topics: a
    user's clicks on a topic early on then say more about their clicks on it later."""
    hard, rank = synthesize("hard", seed=1, num_users=120), synthesize("hard-rank", seed=1, num_users=120)
    for f in ("offsets", "item_ids", "timestamps"):
        assert np.array_equal(getattr(hard, f), getattr(rank, f)), f
    assert not np.array_equal(hard.actions, rank.actions)
    plain = synthesize("tiny", seed=3)
    tasted = synthesize("tiny", seed=3, taste_sigma=3.0)
    assert np.array_equal(plain.item_ids, tasted.item_ids)
    assert _half_consistency(tasted) > _half_consistency(plain) + 0.1
    with pytest.raises(UserError, match="taste_sigma"):
        synthesize("tiny", taste_sigma=-1.0)


def test_an_age_groups_taste_shows_in_its_click_rates_by_topic() -> None:
    """group_taste_sigma: users of one age_range share a taste over topics, so click rates by (age, tag) spread
    further around each tag's rate than without it."""
    def spread(ds) -> float:
        tag = ds.item_features.fields[0].values[ds.item_ids - 1]
        age = ds.user_features.fields[2].values[np.repeat(np.arange(ds.num_users), ds.lengths)]
        click = (ds.actions & 1).astype(float)
        out = []
        for v in np.unique(tag):
            on = tag == v
            rates = [click[on & (age == a)].mean() for a in np.unique(age) if (on & (age == a)).sum() >= 30]
            if len(rates) >= 3:
                out.append(np.std(rates))
        return float(np.mean(out))
    assert spread(synthesize("tiny", seed=5, group_taste_sigma=3.0)) > 1.5 * spread(synthesize("tiny", seed=5))

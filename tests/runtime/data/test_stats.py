"""dataset_stats on hand-built datasets whose statistics are known exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.data.stats import dataset_stats, format_stats, gini, zipf_exponent

pytestmark = pytest.mark.unit


def _toy():
    # 3 users, lengths 2, 3, 5; item 1 has 5 events, item 2 has 3, items 3 and 4 one each; item 5 unseen.
    items = [np.array([1, 2]), np.array([1, 1, 2]), np.array([1, 2, 3, 4, 1])]
    times = [np.array([0, 10]), np.array([100, 100, 200]), np.array([86_400 * k for k in range(5)])]
    actions = [np.array([1, 3]), np.array([0, 1, 5]), np.array([1, 1, 0, 4, 0])]
    return from_sequences([7, 8, 9], items, times, num_items=5, actions=actions,
                          action_names=["click", "like", "long_view"], name="toy",
                          info={"min_len": 2, "dropped_users": 1, "dropped_events": 1})


def test_stats_of_a_hand_built_dataset() -> None:
    s = dataset_stats(_toy())
    assert (s["users"], s["items"], s["items_seen"], s["events"]) == (3, 5, 4, 10)
    assert s["density"] == pytest.approx(10 / 15)
    assert s["length"] == {"min": 2, "mean": pytest.approx(10 / 3), "p50": 3.0, "p90": pytest.approx(4.6),
                           "p99": pytest.approx(4.96), "max": 5}
    assert s["popularity"]["top1pct_share"] == pytest.approx(0.5)  # ceil(1% of 5 items) = 1 item: 5 of 10
    assert s["popularity"]["top10pct_share"] == pytest.approx(0.5)
    assert s["popularity"]["max_item_events"] == 5
    assert s["time"]["first"] == 0 and s["time"]["last"] == 4 * 86_400 and s["time"]["span_days"] == 4.0
    # gaps inside users only: [10], [0, 100], [86400] * 4 -> median 86400
    assert s["time"]["gap_p50_s"] == 86_400.0
    assert s["actions"] == pytest.approx({"click": 0.6, "like": 0.1, "long_view": 0.2})
    assert s["filter"] == {"min_len": 2, "dropped_users": 1, "dropped_events": 1}
    json.dumps(s)  # JSON-ready: plain Python numbers only


def test_zipf_exponent_and_gini() -> None:
    ranks = np.arange(1, 2001)
    assert zipf_exponent(np.round(1e6 * ranks**-1.0)) == pytest.approx(1.0, abs=0.02)
    assert zipf_exponent(np.round(1e6 * ranks**-0.6)) == pytest.approx(0.6, abs=0.02)
    assert gini(np.full(100, 7)) == pytest.approx(0.0)
    assert gini(np.array([0] * 99 + [50])) == pytest.approx(0.99)


def test_format_stats_mentions_the_filter_and_actions() -> None:
    text = format_stats(dataset_stats(_toy()))
    assert "3 users, 5 items (4 seen), 10 events" in text
    assert "kept users with >= 2 events (dropped 1 users, 1 events)" in text
    assert "click 0.600" in text
    assert "top-1% items 50.0% of events" in text

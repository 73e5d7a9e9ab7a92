"""AUC, GAUC and normalised entropy against brute-force references on random data (ties included), and the
one-class cases that have no value."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grstack.runtime.eval import auc, gauc, normalized_entropy, ranking_report

pytestmark = pytest.mark.unit


def pair_auc(y, s):
    """Every (positive, negative) pair: 1 when the positive scores higher, 1/2 on a tie."""
    pos, neg = s[y == 1], s[y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def loop_ne(y, z):
    p = y.mean()
    ll = 0.0
    for yi, zi in zip(y, z, strict=True):
        # log q and log(1 - q) of q = sigmoid(z), written so that 1 - q does not round away
        ll -= yi * -math.log1p(math.exp(-zi)) + (1 - yi) * -math.log1p(math.exp(zi))
    return (ll / len(y)) / -(p * math.log(p) + (1 - p) * math.log(1 - p))


labels_scores = st.integers(2, 60).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 1), min_size=n, max_size=n),
    st.lists(st.integers(-3, 3), min_size=n, max_size=n),  # few distinct values: many ties
    st.lists(st.integers(0, 4), min_size=n, max_size=n)))


@settings(max_examples=200, deadline=None)
@given(labels_scores)
def test_auc_and_gauc_equal_pair_counting(data):
    y, s, g = (np.array(x) for x in data)
    s = s / 2.0
    got = auc(y, s)
    if 0 < y.sum() < len(y):
        assert got.reason is None and got.value == pytest.approx(pair_auc(y, s), abs=1e-12)
    else:
        assert got.value is None and got.reason in ("no positives", "no negatives")
    num = den = 0.0
    used = skipped = 0
    for u in np.unique(g):
        m = g == u
        if 0 < y[m].sum() < m.sum():
            num += m.sum() * pair_auc(y[m], s[m])
            den += m.sum()
            used += 1
        else:
            skipped += 1
    gg = gauc(y, s, g)
    assert (gg.groups, gg.skipped) == (used, skipped)
    if used:
        assert gg.value == pytest.approx(num / den, abs=1e-12)
    else:
        assert gg.value is None and gg.reason


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.floats(-20, 20)), min_size=2, max_size=50))
def test_ne_equals_the_definition(rows):
    y = np.array([r[0] for r in rows], dtype=np.float64)
    z = np.array([r[1] for r in rows])
    got = normalized_entropy(y, z)
    if 0 < y.sum() < len(y):
        assert got.value == pytest.approx(loop_ne(y, z), rel=1e-9)
    else:
        assert got.value is None and got.reason


def test_large_random_auc_matches_pairs_and_is_order_free():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 3000)
    s = np.round(rng.normal(size=3000) + y, 1)  # ties
    pos, neg = s[y == 1], s[y == 0]
    ref = ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))
    assert auc(y, s).value == pytest.approx(ref, abs=1e-15)
    p = rng.permutation(3000)
    assert auc(y[p], s[p]).value == auc(y, s).value


def test_known_values():
    assert auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]).value == 0.75
    assert auc([0, 1], [1.0, 1.0]).value == 0.5  # a tie is half a win
    assert auc([1, 0, 1, 0], [3, 2, 1, 0]).value == 0.75
    # a model predicting only the base rate has NE 1; a perfect-ish one is near 0
    y = np.array([1, 0, 0, 0])
    base = math.log(0.25 / 0.75)
    assert normalized_entropy(y, np.full(4, base)).value == pytest.approx(1.0)
    assert normalized_entropy(y, np.array([30.0, -30, -30, -30])).value < 1e-10
    # user 0: perfect (AUC 1, 3 impressions); user 1: inverted (AUC 0, 2 impressions); user 2: one class
    g = gauc([1, 0, 0, 0, 1, 0], [5, 1, 2, 3, 1, 9], [0, 0, 0, 1, 1, 2])
    assert (g.value, g.groups, g.skipped) == (pytest.approx(3 / 5), 2, 1)


def test_one_class_and_empty_inputs_say_why():
    assert auc([1, 1], [0.2, 0.1]) == (None, "no negatives")
    assert auc([0, 0], [0.2, 0.1]) == (None, "no positives")
    assert auc([], []) == (None, "no impressions")
    assert normalized_entropy([0, 0, 0], [1.0, 2.0, 3.0]) == (None, "no positives")
    g = gauc([1, 1, 0], [1, 2, 3], [0, 0, 1])
    assert g.value is None and (g.groups, g.skipped) == (0, 2) and "both" in g.reason
    with pytest.raises(ValueError):
        auc([0, 2], [1, 2])
    with pytest.raises(ValueError):
        auc([0, 1], [np.nan, 2])


def test_exposure_auc_ranks_the_logged_events_by_their_own_labels():
    """Action tasks: the AUC across users of candidate 0 (the logged next event) against its real label; the
    uniform negatives (label 0 everywhere) do not enter it."""
    labels = np.zeros((4, 3, 2))
    labels[:, 0, 0] = 1
    labels[:, 0, 1] = [1, 0, 1, 0]  # users 0 and 2 clicked the item shown next
    logits = np.zeros((4, 3, 2))
    logits[:, 0, 1] = [0.9, 0.1, 0.2, 0.5]  # clicked 0.9 and 0.2, not clicked 0.1 and 0.5: 3 of 4 pairs won
    logits[:, 1:, 1] = 5.0  # negatives far above: the per-user AUC of click is 0, exposure AUC unaffected
    click = ranking_report(labels, logits, ["next", "click"])["click"]
    assert click["exposure_auc"] == pytest.approx(0.75)
    assert click["gauc"] == pytest.approx(0.0)


def test_ranking_report_groups_by_user_and_names_tasks():
    # 2 users x 3 candidates x 2 tasks; task 1 has no positive at all
    labels = np.zeros((2, 3, 2))
    labels[:, 0, 0] = 1
    logits = np.zeros((2, 3, 2))
    logits[0, :, 0] = [2.0, 0.0, 1.0]  # target first: AUC 1
    logits[1, :, 0] = [0.0, 1.0, 0.0]  # target tied with one, below one: AUC 1/4
    rep = ranking_report(labels, logits, ["next", "click"])
    nxt = rep["next"]
    assert nxt["auc"] == pytest.approx(pair_auc(labels[:, :, 0].ravel(), logits[:, :, 0].ravel()))
    assert nxt["gauc"] == pytest.approx((1.0 + 0.25) / 2)
    assert (nxt["impressions"], nxt["positives"], nxt["gauc_users"], nxt["gauc_users_skipped"]) == (6, 2, 2, 0)
    assert nxt["undefined"] == {}
    click = rep["click"]
    assert click["auc"] is None and click["gauc"] is None and click["ne"] is None
    assert click["undefined"] == {"auc": "no positives", "gauc": "no group has both positives and negatives",
                                  "ne": "no positives", "exposure_auc": "no positives"}
    assert click["gauc_users_skipped"] == 2 and "exposure_auc" not in nxt
    with pytest.raises(ValueError):
        ranking_report(labels, logits, ["next"])


def test_an_exposures_report_groups_each_users_logged_block_and_leaves_next_out():
    """ranking_on=exposures: every candidate is a logged impression with its own labels; task 0 (shown) is not
    reported, GAUC averages each user's AUC over their block, no exposure_auc."""
    labels = np.ones((2, 4, 2))
    labels[0, :, 1] = [1, 0, 1, 0]
    labels[1, :, 1] = [0, 0, 1, 1]
    logits = np.zeros((2, 4, 2))
    logits[0, :, 1] = [3.0, 1.0, 2.0, 0.0]  # user 0: both clicks above both non-clicks, AUC 1
    logits[1, :, 1] = [3.0, 2.0, 1.0, 0.0]  # user 1: both clicks below, AUC 0
    rep = ranking_report(labels, logits, ["next", "click"], "exposures")
    assert list(rep) == ["click"]
    assert rep["click"]["gauc"] == pytest.approx(0.5) and rep["click"]["gauc_users"] == 2
    assert rep["click"]["auc"] == pytest.approx(pair_auc(labels[:, :, 1].ravel(), logits[:, :, 1].ravel()))
    assert rep["click"]["impressions"] == 8 and "exposure_auc" not in rep["click"]
    with pytest.raises(ValueError, match="ranking_on"):
        ranking_report(labels, logits, ["next", "click"], "sampled")

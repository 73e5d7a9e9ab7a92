"""The ranking head evaluated on training-like candidate sets: the sets (target first, seeded negatives that do
not depend on batching), the labels (task 0 = is the target, task t = the target's action bit t-1), and the
metrics on a constructed scorer whose AUC, GAUC and NE are known."""

import numpy as np
import pytest
import torch
from torch import nn

from grstack.runtime.data import LeaveOneOut, from_sequences
from grstack.runtime.eval import evaluate_ranking, has_trained_rank_head, rank_head_logits, ranking_report
from grstack.runtime.eval.rank_head import candidate_labels, eval_candidates
from grstack.runtime.model import build_model
from grstack.runtime.training_config import ModelConfig

pytestmark = pytest.mark.unit

NUM_ITEMS = 50


class ItemScorer(nn.Module):
    """A ranking head that scores a candidate by its item id alone: task t's logit is ``prefs[t][id]``."""

    def __init__(self, prefs: np.ndarray) -> None:
        super().__init__()
        self.prefs = torch.tensor(prefs, dtype=torch.float32)  # [T, I + 1]
        self.num_tasks = self.prefs.shape[0]
        self.rank_head = nn.Identity()
        self.seen: list[torch.Tensor] = []

    def encode(self, batch, item_rows=None):
        self.seen.append(batch.num_targets.clone())
        return torch.zeros(batch.item_ids.numel(), 1)

    def rank_logits(self, cand_outputs, cand_ids, cand_rows=None):
        return self.prefs[:, cand_ids].t()


def _dataset() -> tuple:
    """12 users; every valid target is item 1 (clicked: action bit 0 set), every test target item 2 (not
    clicked); histories from items 3..50."""
    rng = np.random.default_rng(3)
    items, ts, acts = [], [], []
    for _ in range(12):
        n = int(rng.integers(4, 9))
        seq = np.concatenate([rng.integers(3, NUM_ITEMS + 1, n - 2), [1, 2]])
        items.append(seq)
        ts.append(np.arange(n) * 10)
        a = rng.integers(0, 4, n)
        a[-2], a[-1] = 1, 0
        acts.append(a)
    ds = from_sequences(list(range(100, 112)), items, ts, num_items=NUM_ITEMS, actions=acts,
                        action_names=["click", "like"])
    return ds, LeaveOneOut(ds)


def _pairs(y, s):
    pos, neg = s[y == 1], s[y == 0]
    return ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))


def test_candidates_are_target_first_seeded_and_per_user():
    users = np.array([7, 8, 9, 7])
    c = eval_candidates(0, "valid", users, np.array([5, 6, 7, 5]), NUM_ITEMS, 6)
    assert c.shape == (4, 6) and list(c[:, 0]) == [5, 6, 7, 5]
    assert c.min() >= 1 and c.max() <= NUM_ITEMS
    np.testing.assert_array_equal(c[0], c[3])  # the same user gets the same set wherever it sits
    np.testing.assert_array_equal(c[1:3], eval_candidates(0, "valid", users[1:3], np.array([6, 7]), NUM_ITEMS, 6))
    assert not np.array_equal(c, eval_candidates(1, "valid", users, np.array([5, 6, 7, 5]), NUM_ITEMS, 6))
    assert not np.array_equal(c, eval_candidates(0, "test", users, np.array([5, 6, 7, 5]), NUM_ITEMS, 6))
    many = eval_candidates(0, "test", np.arange(2000), np.ones(2000, dtype=np.int64), NUM_ITEMS, 9)[:, 1:]
    counts = np.bincount(many.reshape(-1), minlength=NUM_ITEMS + 1)[1:]
    assert counts.min() > 0.7 * counts.mean() and counts.max() < 1.3 * counts.mean()  # about uniform


def test_labels_follow_training():
    labels = candidate_labels(3, 4, 3, np.array([0b01, 0b10, 0b11]))
    assert labels[:, 0, 0].tolist() == [1, 1, 1]
    assert labels[:, 0, 1].tolist() == [1, 0, 1] and labels[:, 0, 2].tolist() == [0, 1, 1]
    assert labels[:, 1:].sum() == 0
    assert candidate_labels(2, 4, 1, None).sum() == 2


def test_constructed_scorer_gives_the_known_numbers():
    ds, split = _dataset()
    prefs = np.zeros((3, NUM_ITEMS + 1))
    prefs[0, 1], prefs[0, 2] = 5.0, -5.0  # task next: the valid target above every other item, the test one below
    prefs[1] = np.linspace(-1, 1, NUM_ITEMS + 1)
    model = ItemScorer(prefs)
    tasks = ["next", "click", "like"]
    M = 5
    valid = evaluate_ranking(model, split, "valid", tasks, max_len=10, num_candidates=M, seed=0, batch_size=5)
    test = evaluate_ranking(model, split, "test", tasks, max_len=10, num_candidates=M, seed=0, batch_size=5)
    assert all(int(nt) == M for b in model.seen for nt in b)  # M candidate tokens after every history
    cands = eval_candidates(0, "valid", ds.user_ids, np.ones(12, dtype=np.int64), NUM_ITEMS, M)
    ties = int((cands[:, 1:] == 1).sum())  # a negative that is the target item itself ties with it
    assert valid["next"]["auc"] == pytest.approx(1.0 - 0.5 * ties / (12 * 12 * (M - 1)))
    assert (valid["next"]["impressions"], valid["next"]["positives"]) == (12 * M, 12)
    test_cands = eval_candidates(0, "test", ds.user_ids, np.full(12, 2), NUM_ITEMS, M)
    assert test["next"]["auc"] == pytest.approx(0.5 * int((test_cands[:, 1:] == 2).sum()) / (12 * 12 * (M - 1)))
    # task click: every valid target was clicked (bit 0), no test target was
    y = np.zeros((12, M))
    y[:, 0] = 1
    assert valid["click"]["auc"] == pytest.approx(_pairs(y.ravel(), prefs[1][cands].ravel()))
    assert valid["click"]["positives"] == 12 and valid["click"]["gauc_users"] == 12
    assert test["click"]["auc"] is None and test["click"]["undefined"]["auc"] == "no positives"
    assert test["click"]["gauc_users_skipped"] == 12
    # task like (bit 1): not set on any target; scored 0 everywhere, NE undefined, not NaN
    assert valid["like"]["ne"] is None and valid["like"]["positives"] == 0
    # NE of task next on valid, by the definition
    z = prefs[0][cands].ravel()
    ll = np.mean(np.log1p(np.exp(z)) - y.ravel() * z)
    p = 1 / M
    assert valid["next"]["ne"] == pytest.approx(ll / -(p * np.log(p) + (1 - p) * np.log(1 - p)))


def test_hstu_logits_do_not_depend_on_batching_and_match_the_report():
    torch.manual_seed(0)
    _, split = _dataset()
    model = build_model(ModelConfig(type="hstu", d_model=16, num_blocks=1, num_heads=2, dqk=8, dv=8,
                                    dropout=0.0, input_dropout=0.0), NUM_ITEMS, 10, num_tasks=3)
    rows = np.arange(split.num_users)
    kw = dict(max_len=10, device=torch.device("cpu"), num_candidates=4, seed=3)
    lab1, log1 = rank_head_logits(model, split, "test", rows, batch_size=1, **kw)
    lab7, log7 = rank_head_logits(model, split, "test", rows, batch_size=7, **kw)
    np.testing.assert_array_equal(lab1, lab7)
    np.testing.assert_allclose(log1, log7, atol=1e-5)
    assert log1.shape == (12, 4, 3) and model.training  # the mode is restored
    rep = evaluate_ranking(model, split, "test", ["next", "click", "like"], max_len=10, num_candidates=4, seed=3,
                           batch_size=7)
    assert rep == ranking_report(lab7, log7, ["next", "click", "like"])
    assert has_trained_rank_head(model, 0.1) is None
    assert "ranking_weight" in has_trained_rank_head(model, 0.0)
    assert "no ranking head" in has_trained_rank_head(nn.Linear(1, 1), 0.1)


def test_exposures_score_each_users_held_out_block_with_its_own_labels():
    """ranking_on=exposures: the candidates are the user's held-out block of logged events (validation: the
    block before the test block), after the history before it, labelled with their own action bits."""
    rng = np.random.default_rng(5)
    K = 3
    items = [rng.integers(1, NUM_ITEMS + 1, int(n)) for n in rng.integers(3 * K + 2, 20, 10)]
    acts = [rng.integers(0, 4, len(s)) for s in items]
    ds = from_sequences(list(range(200, 210)), items, [np.arange(len(s)) * 7 for s in items], num_items=NUM_ITEMS,
                        actions=acts, action_names=["click", "like"])
    split = LeaveOneOut(ds, block=K)
    prefs = np.zeros((3, NUM_ITEMS + 1))
    prefs[1] = rng.normal(size=NUM_ITEMS + 1)
    model = ItemScorer(prefs)
    rows = np.arange(split.num_users)
    for which, back in (("valid", 2 * K), ("test", K)):
        labels, logits = rank_head_logits(model, split, which, rows, max_len=50, batch_size=4,
                                          device=torch.device("cpu"), num_candidates=K, seed=0,
                                          ranking_on="exposures")
        assert labels.shape == (10, K, 3)
        for u, (s, a) in enumerate(zip(items, acts, strict=True)):
            block = s[len(s) - back : len(s) - back + K]
            np.testing.assert_array_equal(logits[u, :, 1], prefs[1][block].astype(np.float32))
            assert labels[u, :, 0].tolist() == [1.0] * K
            np.testing.assert_array_equal(labels[u, :, 1], a[len(s) - back : len(s) - back + K] & 1)
            np.testing.assert_array_equal(labels[u, :, 2], (a[len(s) - back : len(s) - back + K] >> 1) & 1)
    rep = evaluate_ranking(model, split, "test", ["next", "click", "like"], max_len=50, num_candidates=K, seed=0,
                           ranking_on="exposures")
    assert set(rep) == {"click", "like"}
    with pytest.raises(ValueError, match="ranking block"):
        rank_head_logits(model, split, "test", rows, max_len=50, batch_size=4, device=torch.device("cpu"),
                         num_candidates=K + 1, seed=0, ranking_on="exposures")

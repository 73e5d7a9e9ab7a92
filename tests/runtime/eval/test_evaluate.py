"""Full-ranking evaluation excludes the user's earlier items but never the target itself."""

import numpy as np
import pytest
import torch
from torch import nn

from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.eval.evaluate import evaluate, score_items

pytestmark = pytest.mark.unit


class FixedScores(nn.Module):
    """Scores item i as ``prefs[i]`` for every user (a popularity-like scorer)."""

    def __init__(self, prefs):
        super().__init__()
        self.prefs = torch.tensor(prefs, dtype=torch.float32)

    def encode(self, batch):
        return torch.ones(batch.num_tokens, 1)

    def query_vectors(self, out):
        return out

    def item_vectors(self, ids=None):
        return self.prefs[:, None] if ids is None else self.prefs[ids][:, None]


def test_history_items_are_excluded_target_is_not():
    # items 1..5; user 0: 5 4 3 2 1 ; valid target 2 (history 5 4 3), test target 1 (history 5 4 3 2)
    ds = from_sequences([0], [np.array([5, 4, 3, 2, 1])], [np.arange(5)], num_items=5)
    split = LeaveOneOut(ds)
    model = FixedScores([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])  # item 5 best, then 4, ...
    # test: history {5,4,3,2} excluded -> target 1 is the only item left -> rank 0
    assert evaluate(model, split, "test", max_len=10, ks=[1])["hr@1"] == 1.0
    # valid: history {5,4,3} excluded; target 2 beats item 1 -> rank 0
    assert evaluate(model, split, "valid", max_len=10, ks=[1])["hr@1"] == 1.0


def test_repeated_target_is_still_ranked():
    ds = from_sequences([0], [np.array([3, 1, 2, 3])], [np.arange(4)], num_items=5)
    model = FixedScores([0.0, 1.0, 2.0, 9.0, 4.0, 5.0])
    # test target 3 also appears in the history: it keeps its (top) score
    assert evaluate(model, LeaveOneOut(ds), "test", max_len=10, ks=[1])["hr@1"] == 1.0


def test_score_items_is_the_same_dot_product_whatever_the_shapes():
    """Sharded evaluation scores a shard's rows for several ranks' users at once and compares with the
    target's score from another rank's matmul: every score must not depend on M, N or its place (CPU BLAS
    takes other kernels for a few rows on either side; score_items pads them)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for d in (16, 50, 64):
        items = torch.nn.functional.normalize(torch.randn(700, d, generator=g), dim=-1)
        q = torch.nn.functional.normalize(torch.randn(300, d, generator=g), dim=-1)
        ref = score_items(q, items)
        for m, n, qo, io in [(1, 700, 5, 0), (2, 3, 0, 17), (3, 11, 100, 600), (1, 1, 299, 699), (37, 12, 3, 4),
                             (300, 5, 0, 1), (250, 690, 50, 10)]:
            assert torch.equal(score_items(q[qo : qo + m], items[io : io + n]), ref[qo : qo + m, io : io + n])
        for G in (2, 3, 7):
            for s in range(G):
                assert torch.equal(score_items(q[:2], items[s::G].contiguous()), ref[:2, s::G])

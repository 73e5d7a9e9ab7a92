"""Full-ranking evaluation excludes the user's earlier items but never the target itself."""

import numpy as np
import pytest
import torch
from torch import nn

from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.eval.evaluate import evaluate

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

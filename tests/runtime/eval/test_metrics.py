import math

import numpy as np
import pytest
import torch

from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks

pytestmark = pytest.mark.unit


def test_metrics_hand_computed():
    ranks = np.array([0, 1, 9, 10, 200])
    m = metrics_from_ranks(ranks, [10, 50, 200])
    assert m["hr@10"] == pytest.approx(3 / 5)
    assert m["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(11)) / 5)
    assert m["hr@50"] == pytest.approx(4 / 5)
    assert m["ndcg@50"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(11) + 1 / math.log2(12)) / 5)
    assert m["hr@200"] == pytest.approx(4 / 5)  # rank 200 is the 201st place
    assert m["mrr"] == pytest.approx((1 + 1 / 2 + 1 / 10 + 1 / 11 + 1 / 201) / 5)


def test_ranks_count_ties_against_the_target():
    scores = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    targets = torch.tensor([2, 2])
    assert target_ranks(scores, targets).tolist() == [2, 1]
    flat = torch.zeros(1, 100)
    assert metrics_from_ranks(target_ranks(flat, torch.tensor([5])).numpy(), [10])["hr@10"] == 0.0

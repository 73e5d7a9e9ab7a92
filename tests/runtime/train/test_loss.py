"""Sampled softmax: the sharing modes agree with a per-token loop, collisions are masked."""

import pytest
import torch
import torch.nn.functional as F

from grstack.runtime.train.loss import negative_shape, sampled_softmax_loss

pytestmark = pytest.mark.unit


def _loop_loss(q, pos, neg_per_token, targets, ids_per_token, t):
    losses = []
    for i in range(q.shape[0]):
        logits = torch.cat([(q[i] * pos[i]).sum()[None], neg_per_token[i] @ q[i]])
        logits[1:][ids_per_token[i] == targets[i]] = -1e9
        losses.append(torch.logsumexp(logits / t, 0) - logits[0] / t)
    return torch.stack(losses).mean()


def test_group_sharing_equals_the_per_token_definition():
    g = torch.Generator().manual_seed(0)
    n, d, r, items = 11, 8, 5, 7
    table = F.normalize(torch.randn(items + 1, d, generator=g), dim=-1)
    q = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    targets = torch.randint(1, items + 1, (n,), generator=g)
    for groups in (1, 3, n):
        ids = torch.randint(1, items + 1, (groups, r), generator=g)
        k = -(-n // groups)
        per_token_ids = ids[torch.arange(n) // k]
        got = sampled_softmax_loss(q, table[targets], table[ids], targets, ids, 0.1)
        want = _loop_loss(q, table[targets], table[per_token_ids], targets, per_token_ids, 0.1)
        torch.testing.assert_close(got, want)
    shared = torch.randint(1, items + 1, (r,), generator=g)
    got = sampled_softmax_loss(q, table[targets], table[shared], targets, shared, 0.1)
    want = _loop_loss(q, table[targets], table[shared].expand(n, r, d), targets, shared.expand(n, r), 0.1)
    torch.testing.assert_close(got, want)


def test_a_negative_equal_to_the_target_does_not_count():
    q = torch.tensor([[1.0, 0.0]])
    items = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    with_collision = sampled_softmax_loss(q, items[[1]], items[[1, 2]], torch.tensor([1]),
                                          torch.tensor([1, 2]), 1.0)
    without = sampled_softmax_loss(q, items[[1]], items[[2]], torch.tensor([1]), torch.tensor([2]), 1.0)
    torch.testing.assert_close(with_collision, without)


def test_negative_shapes():
    assert negative_shape("batch", 100, 8, 16) == (8,)
    assert negative_shape("token", 100, 8, 16) == (100, 8)
    assert negative_shape("group", 100, 8, 16) == (7, 8)

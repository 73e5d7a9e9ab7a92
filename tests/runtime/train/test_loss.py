"""The sampled softmax (sum over tokens): every sharing mode agrees with a per-token loop, both ways of
laying out negative sets (consecutive sets and any assignment) agree, collisions are masked."""

import pytest
import torch
import torch.nn.functional as F

from grstack.runtime.train.negatives import sampled_softmax_sum, share_permutations

pytestmark = pytest.mark.unit


def _loop_loss(q, pos, neg_per_token, targets, ids_per_token, t):
    """Sum over tokens of InfoNCE, one token at a time: the definition."""
    losses = []
    for i in range(q.shape[0]):
        logits = torch.cat([(q[i] * pos[i]).sum()[None], neg_per_token[i] @ q[i]])
        logits[1:][ids_per_token[i] == targets[i]] = -1e9
        losses.append(torch.logsumexp(logits / t, 0) - logits[0] / t)
    return torch.stack(losses).sum()


def _case(n=11, d=8, items=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = F.normalize(torch.randn(items + 1, d, generator=g), dim=-1)
    q = F.normalize(torch.randn(n, d, generator=g), dim=-1)
    targets = torch.randint(1, items + 1, (n,), generator=g)
    return g, table, q, targets


@pytest.mark.parametrize("groups", [1, 3, 4, 11])
def test_consecutive_sets_equal_the_per_token_definition(groups):
    g, table, q, targets = _case()
    n, r = q.shape[0], 5
    ids = torch.randint(1, 8, (groups, r), generator=g)
    k = -(-n // groups)
    group_of = torch.arange(n) // k
    got = sampled_softmax_sum(q, table[targets], table[ids], targets, ids, 0.1, group_of)
    want = _loop_loss(q, table[targets], table[ids[group_of]], targets, ids[group_of], 0.1)
    torch.testing.assert_close(got, want)


def test_any_assignment_of_tokens_to_sets_and_batch_sharing():
    g, table, q, targets = _case()
    n, r = q.shape[0], 5
    ids = torch.randint(1, 8, (3, r), generator=g)
    group_of = torch.tensor([2, 0, 1, 1, 0, 2, 0, 1, 2, 2, 0])  # micro-batches hold tokens of sets in any order
    got = sampled_softmax_sum(q, table[targets], table[ids], targets, ids, 0.1, group_of)
    want = _loop_loss(q, table[targets], table[ids[group_of]], targets, ids[group_of], 0.1)
    torch.testing.assert_close(got, want)
    grads = [torch.autograd.grad(sampled_softmax_sum(q.requires_grad_(True), table[targets], table[ids], targets,
                                                     ids, 0.1, go), q)[0] for go in (group_of, group_of.clone())]
    torch.testing.assert_close(grads[0], grads[1])
    shared = torch.randint(1, 8, (r,), generator=g)
    got = sampled_softmax_sum(q.detach(), table[targets], table[shared], targets, shared, 0.1)
    want = _loop_loss(q.detach(), table[targets], table[shared].expand(n, r, -1), targets, shared.expand(n, r), 0.1)
    torch.testing.assert_close(got, want)


def test_logit_sharing_adds_the_other_sets_negatives():
    g, table, q, targets = _case()
    n, r = q.shape[0], 4
    ids = torch.randint(1, 8, (3, r), generator=g)
    group_of = torch.arange(n) // 4
    perms = share_permutations(3, 2, torch.Generator().manual_seed(1))
    got = sampled_softmax_sum(q, table[targets], table[ids], targets, ids, 0.1, group_of, perms)
    per_token = torch.cat([ids[group_of], ids[perms[0]][group_of]], dim=1)
    want = _loop_loss(q, table[targets], table[per_token], targets, per_token, 0.1)
    torch.testing.assert_close(got, want)


def test_a_negative_equal_to_the_target_does_not_count():
    q = torch.tensor([[1.0, 0.0]])
    items = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    with_collision = sampled_softmax_sum(q, items[[1]], items[[1, 2]], torch.tensor([1]), torch.tensor([1, 2]), 1.0)
    without = sampled_softmax_sum(q, items[[1]], items[[2]], torch.tensor([1]), torch.tensor([2]), 1.0)
    torch.testing.assert_close(with_collision, without)


def test_full_softmax_is_cross_entropy_over_the_whole_catalogue():
    from grstack.runtime.train.negatives import batch_negatives
    from grstack.runtime.training_config import LossConfig

    g, table, q, targets = _case(n=9, items=7)
    ids = batch_negatives(LossConfig(full_softmax=True, sharing="batch"), 7, 3, False, g)
    assert ids.tolist() == list(range(1, 8))  # every item, nothing drawn
    t = 0.05
    got = sampled_softmax_sum(q, table[targets], table[ids], targets, ids, t)
    want = F.cross_entropy(q @ table[1:].t() / t, targets - 1, reduction="sum")
    torch.testing.assert_close(got, want)
    sampled = batch_negatives(LossConfig(negatives=4, sharing="group"), 7, 3, True, g)
    assert sampled.shape == (3, 4) and int(sampled.min()) >= 1 and int(sampled.max()) <= 7


def test_full_softmax_needs_batch_sharing():
    from pydantic import ValidationError

    from grstack.runtime.training_config import Config

    with pytest.raises(ValidationError, match=r"loss\.full_softmax=true .* needs loss\.sharing=batch, not 'group'"):
        Config.model_validate({"loss": {"full_softmax": True, "sharing": "group"}})
    assert Config.model_validate({"loss": {"full_softmax": True, "sharing": "batch"}}).loss.full_softmax

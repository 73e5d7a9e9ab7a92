"""Sharding plans, sparse optimizers and lookup units, in one process."""

import pytest
import torch

from grstack.runtime.embedding.optim import (
    DenseAdamW,
    LazyAdam,
    RowWiseAdagrad,
    SparseSGD,
    make_sparse_optimizer,
)
from grstack.runtime.embedding.plan import ShardingPlan
from grstack.runtime.embedding.sharded import make_unit
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("rows", "world", "group"), [(101, 4, 0), (101, 4, 2), (7, 2, 1), (16, 8, 4)])
def test_every_row_has_exactly_one_place_per_group(rows, world, group):
    plan = ShardingPlan.make(rows, 8, world, group)
    ids = torch.arange(rows)
    owner, local = plan.owner(ids), plan.local_row(ids)
    for s in range(plan.group_size):
        mine = ids[owner == s]
        assert torch.equal(plan.global_ids(s, local[owner == s]), mine)
        assert int(local[owner == s].max()) + 1 == plan.shard_rows(s) == mine.numel()
    assert sum(plan.shard_rows(s) for s in range(plan.group_size)) == rows
    assert plan.replica_ranks(1) == [1 + g * plan.group_size for g in range(plan.num_groups)]


def test_unsatisfiable_plans_name_the_setting():
    with pytest.raises(UserError, match="sparse_group_size=3 must divide the number of ranks"):
        ShardingPlan.make(100, 8, 4, 3)
    with pytest.raises(UserError, match=r"cannot be satisfied.*max_shard_rows=10.*at least 10 ranks"):
        ShardingPlan.make(100, 8, 4, 2, max_shard_rows=10)
    with pytest.raises(UserError, match="exceeds the 3 embedding rows"):
        ShardingPlan.make(3, 8, 4, 4)
    assert ShardingPlan.make(100, 8, 4, 4, max_shard_rows=25).shard_rows(0) == 25


def test_lazy_adam_matches_torch_sparse_adam():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(20, 6, generator=g)
    ours = w0.clone()
    opt = LazyAdam(ours, lr=0.05, betas=(0.9, 0.98))
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.SparseAdam([ref], lr=0.05, betas=(0.9, 0.98), eps=1e-8)
    for _ in range(5):
        rows = torch.randperm(20, generator=g)[:7].sort().values
        grad = torch.randn(7, 6, generator=g)
        changed, new = opt.step(rows, grad)
        assert torch.equal(changed, rows) and torch.equal(new, ours[rows])
        ref.grad = torch.sparse_coo_tensor(rows[None], grad, (20, 6), check_invariants=True)
        ref_opt.step()
    torch.testing.assert_close(ours, ref.detach(), atol=1e-6, rtol=1e-5)


def test_dense_adamw_is_torch_adamw_on_an_embedding():
    """One shard under ``adamw`` trains exactly as nn.Embedding under torch AdamW (fused, as the dense part):
    untouched rows keep moving."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(20, 6, generator=g)
    ours = w0.clone()
    opt = DenseAdamW(ours, lr=0.05, betas=(0.9, 0.98), weight_decay=0.01)
    emb = torch.nn.Embedding.from_pretrained(w0.clone(), freeze=False)
    ref_opt = torch.optim.AdamW(emb.parameters(), lr=0.05, betas=(0.9, 0.98), weight_decay=0.01, fused=True)
    for step in range(4):
        ids = torch.randint(0, 20, (9,), generator=g)
        coef = torch.randn(9, 6, generator=g)
        ref_opt.zero_grad()
        (emb(ids) * coef).sum().backward()
        ref_opt.step()
        rows, inv = torch.unique(ids, return_inverse=True)
        grad = torch.zeros(rows.numel(), 6).index_add_(0, inv, coef)
        opt.lr = 0.05
        changed, new = opt.step(rows, grad)
        assert changed.numel() == 20 and torch.equal(new, ours)
        assert torch.equal(ours, emb.weight.detach()), step
    state = opt.state_dict()
    other = DenseAdamW(ours.clone(), lr=0.05, betas=(0.9, 0.98), weight_decay=0.01)
    other.load_state_dict(state)
    assert other.steps == 4
    torch.testing.assert_close(other.inner.state_dict()['state'][0]['exp_avg'],
                               opt.inner.state_dict()['state'][0]['exp_avg'])


def test_rowwise_adagrad_and_sgd_touch_only_given_rows():
    w = torch.ones(10, 4)
    opt = RowWiseAdagrad(w, lr=0.1)
    rows = torch.tensor([2, 5])
    grad = torch.tensor([[1.0, 1, 1, 1], [2.0, 0, 0, 0]])
    opt.step(rows, grad)
    # accumulator = mean(g^2): 1 and 1; update = lr * g / sqrt(acc)
    assert torch.allclose(w[2], torch.full((4,), 0.9))
    assert torch.allclose(w[5], torch.tensor([0.8, 1, 1, 1]))
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(w[untouched], torch.ones(8, 4))
    state = opt.state_dict()
    w2 = torch.ones(10, 4)
    opt2 = make_sparse_optimizer("adagrad", w2, 0.1)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.acc, opt.acc)
    s = SparseSGD(torch.zeros(3, 2), lr=0.5)
    s.step(torch.tensor([1]), torch.ones(1, 2))
    assert torch.equal(s.weight, torch.tensor([[0.0, 0], [-0.5, -0.5], [0, 0]]))
    with pytest.raises(ValueError, match="adam"):
        make_sparse_optimizer("adam", torch.zeros(3, 2), 0.1).load_state_dict(state)


def test_units_dedupe_and_put_negative_only_keys_last():
    full = torch.tensor([5, 3, 5, 9])
    half = torch.tensor([[3, 7], [7, 1]])
    unit, inv_f, inv_h = make_unit(full, half.reshape(-1))
    assert unit.keys.tolist() == [3, 5, 9, 1, 7] and unit.n_full == 3
    assert torch.equal(unit.keys[inv_f], full)
    assert torch.equal(unit.keys[inv_h], half.reshape(-1))
    # a negative that is also a positive uses the full-precision row
    assert int(inv_h[0]) < unit.n_full
    only, inv, none = make_unit(torch.tensor([4, 4, 2]))
    assert only.keys.tolist() == [2, 4] and none is None and torch.equal(only.keys[inv], torch.tensor([4, 4, 2]))

"""The CPU reference (grouped engine, hand-written backward): bf16, plan reuse, edge cases, group merging.

fp64 equality with the plain-autograd padded formulation on random batches is a property test
(test_properties.py).
"""

from __future__ import annotations

import pytest
import torch

from grstack.kernels import AttentionInputs, make_plan
from grstack.kernels.reference import hstu_attention_padded, hstu_attention_reference

pytestmark = pytest.mark.unit


def _grads(fn, case, dtype, use_pos, use_time, use_targets, plan=None):
    q, k, v = (t.to(dtype).requires_grad_() for t in (case.q, case.k, case.v))
    pw = case.pos_weight.clone().requires_grad_() if use_pos else None
    tw = case.time_weight.clone().requires_grad_() if use_time else None
    kw = dict(max_seq_len=case.max_seq_len, timestamps=case.timestamps if use_time else None, pos_weight=pw,
              time_weight=tw, num_targets=case.num_targets if use_targets else None)
    inputs = AttentionInputs(q, k, v, case.offsets, **kw)
    out = fn(inputs, plan) if plan is not None else fn(inputs)
    leaves = [t for t in (q, k, v, pw, tw) if t is not None]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


def test_reference_bf16_close_to_padded(jagged_case):
    case = jagged_case([0, 1, 30, 150, 7], 2, 16, 16, seed=3, max_seq_len=256)
    ref = _grads(hstu_attention_reference, case, torch.bfloat16, True, True, True)
    pad = _grads(hstu_attention_padded, case, torch.bfloat16, True, True, True)
    for got, want in zip(ref, pad, strict=True):
        assert got.dtype == want.dtype
        scale = max(1.0, float(want.float().abs().max()))
        assert float((got.float() - want.float()).abs().max()) <= 3e-2 * scale


def test_plan_constants_are_reused_and_keyed_by_inputs(jagged_case):
    case = jagged_case([5, 9, 3], 2, 8, 8, seed=4)
    plan = make_plan(case.offsets)
    kw = dict(max_seq_len=64, pos_weight=case.pos_weight, time_weight=case.time_weight)
    def inputs(ts):
        return AttentionInputs(case.q, case.k, case.v, case.offsets, timestamps=ts, **kw)

    a = hstu_attention_reference(inputs(case.timestamps), plan)
    entries = len(plan.cache)
    b = hstu_attention_reference(inputs(case.timestamps), plan)
    assert len(plan.cache) == entries and torch.equal(a, b)
    shifted = case.timestamps * 1000  # other timestamps: other buckets, not a stale cache hit
    c = hstu_attention_reference(inputs(shifted), plan)
    d = hstu_attention_reference(inputs(shifted))
    assert torch.equal(c, d) and not torch.equal(a, c)


def test_no_grad_inference_and_empty_batch():
    with torch.no_grad():
        out = hstu_attention_reference(AttentionInputs(torch.randn(4, 1, 8), torch.randn(4, 1, 8),
                                                       torch.randn(4, 1, 8), torch.tensor([0, 4]), max_seq_len=8))
    assert out.shape == (4, 1, 8)
    empty = hstu_attention_reference(AttentionInputs(torch.zeros(0, 2, 8), torch.zeros(0, 2, 8),
                                                     torch.zeros(0, 2, 4), torch.tensor([0, 0, 0]), max_seq_len=8))
    assert empty.shape == (0, 2, 4)


def test_plan_group_merging_trades_padding_for_fewer_groups(offsets_of):
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 0, 144]
    offsets = offsets_of(lengths)
    per_class = make_plan(offsets, group_overhead=0)
    merged = make_plan(offsets)
    single = make_plan(offsets, group_overhead=10**12)
    assert len(single.groups) == 1 < len(merged.groups) < len(per_class.groups)
    for plan in (per_class, merged, single):
        covered = sorted(int(b) for g in plan.groups for b in g.seq)
        assert covered == [b for b, n in enumerate(lengths) if n > 0]  # every non-empty sequence once
        assert all(g.max_len == int(g.lengths.max()) for g in plan.groups)
    assert single.groups[0].max_len == 144

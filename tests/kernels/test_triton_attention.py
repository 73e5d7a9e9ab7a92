"""Fused Triton HSTU attention: edge cases against the torch reference (random batches, forward, backward and
the cached-prefix forward, are property tests in test_properties.py).

On CPU these run in the Triton interpreter (see conftest), with small shapes. The interpreter cannot
multiply bf16 in ``tl.dot`` (it multiplies the raw bit patterns), so interpreted kernels round dot operands
to bf16 and multiply in fp32; bf16 loads, stores and roundings are exercised, bf16 tensor-core dots only
on a GPU (``GRSTACK_KERNEL_TEST_DEVICE=cuda``).
"""

from __future__ import annotations

import pytest
import torch

from grstack.kernels import AttentionInputs, triton_hstu
from grstack.kernels.reference import hstu_attention_reference

pytestmark = pytest.mark.unit


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    actual, expected = actual.detach(), expected.detach()
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


def test_all_candidates_and_single_tokens(jagged_case, device):
    """num_targets == length (no history: every token sees only itself) and length-1 sequences."""
    case = jagged_case([1, 3, 1, 20], 2, 16, 16, seed=11, device=device)
    nt = (case.offsets[1:] - case.offsets[:-1]).clone()
    q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
    pos = case.pos_weight.clone().requires_grad_()
    out = triton_hstu.hstu_attention_triton(AttentionInputs(q, k, v, case.offsets, max_seq_len=64, pos_weight=pos,
                                            num_targets=nt))
    ref = hstu_attention_reference(AttentionInputs(case.q, case.k, case.v, case.offsets, max_seq_len=64,
                                   pos_weight=case.pos_weight, num_targets=nt))
    _close(out, ref, 2e-5, "out")
    # every token attends only to itself: out_i = silu(q_i.k_i + pos_w[0]) / N * v_i
    s = (case.q * case.k).sum(-1, keepdim=True) + case.pos_weight[0]
    _close(out, torch.nn.functional.silu(s) / 64 * case.v, 2e-5, "diagonal-only")
    out.sum().backward()
    assert pos.grad is not None and torch.count_nonzero(pos.grad[1:]) == 0


def test_empty_batch(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    offsets = torch.zeros(3, dtype=torch.int64, device=device)
    out = triton_hstu.hstu_attention_triton(AttentionInputs(q, q, q, offsets, max_seq_len=8))
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_non_contiguous_views(jagged_case, device):
    """q, k, v as column slices of one projection (how the model produces them)."""
    case = jagged_case([5, 0, 18], 2, 16, 16, seed=12, device=device)
    fused = torch.cat([case.q, case.k, case.v], dim=-1).requires_grad_()
    q, k, v = fused[..., :16], fused[..., 16:32], fused[..., 32:]
    out = triton_hstu.hstu_attention_triton(AttentionInputs(q, k, v, case.offsets, max_seq_len=64,
                                                            pos_weight=case.pos_weight))
    (out * out).sum().backward()
    fused_ref = torch.cat([case.q, case.k, case.v], dim=-1).requires_grad_()
    ref = hstu_attention_reference(AttentionInputs(fused_ref[..., :16], fused_ref[..., 16:32], fused_ref[..., 32:],
                                   case.offsets, max_seq_len=64, pos_weight=case.pos_weight))
    (ref * ref).sum().backward()
    _close(out, ref, 2e-5, "out")
    _close(fused.grad, fused_ref.grad, 2e-5, "grad")

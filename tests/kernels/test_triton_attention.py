"""Fused Triton HSTU attention (forward, backward, cached-prefix forward) against the torch reference.

On CPU these run in the Triton interpreter (see conftest), with small shapes. The interpreter cannot
multiply bf16 in ``tl.dot`` (it multiplies the raw bit patterns), so interpreted kernels round dot operands
to bf16 and multiply in fp32; bf16 loads, stores and roundings are exercised, bf16 tensor-core dots only
on a GPU (``GRSTACK_KERNEL_TEST_DEVICE=cuda``).
"""

from __future__ import annotations

import random

import pytest
import torch

from grstack.kernels import triton_hstu
from grstack.kernels.reference import hstu_attention_reference, hstu_attention_with_prefix_reference

pytestmark = pytest.mark.unit

# (seed, heads, dqk, dv, use_pos, use_time, use_targets, dtype)
CASES = [
    (0, 2, 16, 16, True, True, True, torch.float32),
    (1, 1, 24, 24, True, True, False, torch.float32),
    (2, 2, 32, 16, False, False, False, torch.float32),
    (3, 1, 16, 32, True, False, True, torch.float32),
    (4, 2, 16, 16, False, True, True, torch.float32),
    (5, 3, 8, 8, True, True, True, torch.float32),
    (6, 2, 16, 16, True, True, True, torch.bfloat16),
    (7, 1, 32, 32, True, False, False, torch.bfloat16),
    (8, 2, 24, 16, False, True, True, torch.bfloat16),
]


def _lengths(seed: int) -> list[int]:
    """Random jagged lengths that always include an empty and a single-token sequence."""
    rng = random.Random(seed)
    lengths = [0, 1] + [rng.choice([2, 7, 16, 17, rng.randint(2, 45)]) for _ in range(rng.randint(1, 3))]
    rng.shuffle(lengths)
    return lengths


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    actual, expected = actual.detach(), expected.detach()
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


def _kwargs(case, use_pos, use_time, use_targets, dtype=torch.float32):
    return dict(
        max_seq_len=case.max_seq_len,
        timestamps=case.timestamps if use_time else None,
        pos_weight=case.pos_weight.to(dtype).requires_grad_() if use_pos else None,
        time_weight=case.time_weight.to(dtype).requires_grad_() if use_time else None,
        num_targets=case.num_targets if use_targets else None,
    )


@pytest.mark.parametrize("seed,heads,dqk,dv,use_pos,use_time,use_targets,dtype", CASES)
def test_forward_backward_match_reference(jagged_case, device, seed, heads, dqk, dv, use_pos, use_time,
                                          use_targets, dtype):
    case = jagged_case(_lengths(seed), heads, dqk, dv, seed=seed, device=device)
    q, k, v = (t.to(dtype).requires_grad_() for t in (case.q, case.k, case.v))
    kw = _kwargs(case, use_pos, use_time, use_targets)
    out = triton_hstu.hstu_attention_triton(q, k, v, case.offsets, **kw)
    assert out.dtype == dtype and out.shape == (q.shape[0], heads, dv)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(device)
    leaves = [t for t in (q, k, v, kw["pos_weight"], kw["time_weight"]) if t is not None]
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))

    # oracle: the reference in fp32 on the same (possibly bf16-rounded) inputs
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    kw32 = _kwargs(case, use_pos, use_time, use_targets)
    ref = hstu_attention_reference(q32, k32, v32, case.offsets, **kw32)
    leaves32 = [t for t in (q32, k32, v32, kw32["pos_weight"], kw32["time_weight"]) if t is not None]
    ref_grads = torch.autograd.grad(ref, leaves32, grad_out)

    tol = 2e-5 if dtype == torch.float32 else 3e-2
    _close(out, ref, tol, "out")
    names = ["dq", "dk", "dv"] + ["dpos"] * use_pos + ["dtime"] * use_time
    for name, g, rg in zip(names, grads, ref_grads, strict=True):
        _close(g, rg, tol, name)


def test_all_candidates_and_single_tokens(jagged_case, device):
    """num_targets == length (no history: every token sees only itself) and length-1 sequences."""
    case = jagged_case([1, 3, 1, 20], 2, 16, 16, seed=11, device=device)
    nt = (case.offsets[1:] - case.offsets[:-1]).clone()
    q, k, v = (t.clone().requires_grad_() for t in (case.q, case.k, case.v))
    pos = case.pos_weight.clone().requires_grad_()
    out = triton_hstu.hstu_attention_triton(q, k, v, case.offsets, max_seq_len=64, pos_weight=pos,
                                            num_targets=nt)
    ref = hstu_attention_reference(case.q, case.k, case.v, case.offsets, max_seq_len=64,
                                   pos_weight=case.pos_weight, num_targets=nt)
    _close(out, ref, 2e-5, "out")
    # every token attends only to itself: out_i = silu(q_i.k_i + pos_w[0]) / N * v_i
    s = (case.q * case.k).sum(-1, keepdim=True) + case.pos_weight[0]
    _close(out, torch.nn.functional.silu(s) / 64 * case.v, 2e-5, "diagonal-only")
    out.sum().backward()
    assert pos.grad is not None and torch.count_nonzero(pos.grad[1:]) == 0


def test_empty_batch(device):
    q = torch.zeros(0, 2, 16, device=device, requires_grad=True)
    offsets = torch.zeros(3, dtype=torch.int64, device=device)
    out = triton_hstu.hstu_attention_triton(q, q, q, offsets, max_seq_len=8)
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_non_contiguous_views(jagged_case, device):
    """q, k, v as column slices of one projection (how the model produces them)."""
    case = jagged_case([5, 0, 18], 2, 16, 16, seed=12, device=device)
    fused = torch.cat([case.q, case.k, case.v], dim=-1).requires_grad_()
    q, k, v = fused[..., :16], fused[..., 16:32], fused[..., 32:]
    out = triton_hstu.hstu_attention_triton(q, k, v, case.offsets, max_seq_len=64, pos_weight=case.pos_weight)
    (out * out).sum().backward()
    fused_ref = torch.cat([case.q, case.k, case.v], dim=-1).requires_grad_()
    ref = hstu_attention_reference(fused_ref[..., :16], fused_ref[..., 16:32], fused_ref[..., 32:],
                                   case.offsets, max_seq_len=64, pos_weight=case.pos_weight)
    (ref * ref).sum().backward()
    _close(out, ref, 2e-5, "out")
    _close(fused.grad, fused_ref.grad, 2e-5, "grad")


def _split_prefix(case, prefix_lengths: list[int]):
    """Splits every sequence of ``case`` into a cached prefix and new tokens."""
    pre_idx, new_idx, new_lengths = [], [], []
    for b, (length, p) in enumerate(zip(case.lengths, prefix_lengths, strict=True)):
        start = int(case.offsets[b])
        pre_idx += range(start, start + p)
        new_idx += range(start + p, start + length)
        new_lengths.append(length - p)
    return torch.tensor(pre_idx, dtype=torch.int64), torch.tensor(new_idx, dtype=torch.int64), new_lengths


@pytest.mark.parametrize("seed,dtype", [(20, torch.float32), (21, torch.float32), (22, torch.bfloat16)])
def test_prefix_variant_matches_full_sequence(jagged_case, offsets_of, device, seed, dtype):
    rng = random.Random(seed)
    lengths = [1, 0, 6, 19, 33, 2]
    case = jagged_case(lengths, 2, 16, 16, seed=seed, device=device)
    prefix = [rng.randint(0, length) for length in lengths]
    prefix[0] = 0  # no cached prefix at all
    prefix[3] = lengths[3]  # nothing new
    new_lengths = [length - p for length, p in zip(lengths, prefix, strict=True)]
    nt = torch.tensor([rng.randint(0, n) for n in new_lengths], dtype=torch.int64, device=device)
    pre, new, _ = _split_prefix(case, prefix)
    q, k, v = (t.to(dtype) for t in (case.q, case.k, case.v))
    kw = dict(max_seq_len=case.max_seq_len, pos_weight=case.pos_weight, time_weight=case.time_weight,
              num_targets=nt)
    out = triton_hstu.hstu_attention_with_prefix_triton(
        q[new], k[new], v[new], offsets_of(new_lengths).to(device), k[pre], v[pre],
        offsets_of(prefix).to(device), timestamps=case.timestamps[new], prefix_timestamps=case.timestamps[pre],
        **kw)
    full = hstu_attention_reference(q.float(), k.float(), v.float(), case.offsets,
                                    timestamps=case.timestamps, **kw)[new]
    _close(out, full, 2e-5 if dtype == torch.float32 else 3e-2, "prefix vs full")


@pytest.mark.parametrize("seed", range(6))
def test_reference_prefix_variant_equals_full_sequence(jagged_case, offsets_of, seed):
    """The serving reference (computed on [S, P+S] rectangles) equals the full-sequence reference's rows."""
    rng = random.Random(100 + seed)
    lengths = [rng.choice([0, 1, rng.randint(2, 80)]) for _ in range(rng.randint(1, 6))]
    case = jagged_case(lengths, rng.randint(1, 3), rng.choice([8, 16]), rng.choice([8, 16]), seed=seed,
                       max_seq_len=128)
    prefix = [rng.randint(0, length) for length in lengths]
    pre, new, new_lengths = _split_prefix(case, prefix)
    use_targets, use_time, use_pos = rng.random() < 0.7, rng.random() < 0.7, rng.random() < 0.8
    nt = torch.tensor([rng.randint(0, n) for n in new_lengths], dtype=torch.int64) if use_targets else None
    kw = dict(max_seq_len=case.max_seq_len, pos_weight=case.pos_weight if use_pos else None,
              time_weight=case.time_weight if use_time else None, num_targets=nt)
    out = hstu_attention_with_prefix_reference(
        case.q[new], case.k[new], case.v[new], offsets_of(new_lengths), case.k[pre], case.v[pre],
        offsets_of(prefix), timestamps=case.timestamps[new], prefix_timestamps=case.timestamps[pre], **kw)
    full = hstu_attention_reference(case.q, case.k, case.v, case.offsets, timestamps=case.timestamps, **kw)
    torch.testing.assert_close(out, full[new], rtol=1e-5, atol=1e-6)

"""Triton jagged layer-norm-times-U and embedding gather against torch, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grstack.kernels import triton_embedding, triton_norm
from grstack.kernels.reference import embedding_gather_reference, layer_norm_mul_reference

pytestmark = pytest.mark.unit


def _close(actual, expected, tol, what):
    actual, expected = actual.detach(), expected.detach()
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


@pytest.mark.parametrize(
    "rows,dim,affine,dtype",
    [(0, 32, True, torch.float32), (1, 32, True, torch.float32), (37, 48, True, torch.float32),
     (300, 16, False, torch.float32), (23, 64, True, torch.bfloat16), (9, 24, False, torch.bfloat16)],
)
def test_layer_norm_mul(device, rows, dim, affine, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x = (3 * torch.randn(rows, dim, generator=g) + 1).to(device, dtype)
    u = torch.randn(rows, dim, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(device) if affine else None
    b = (0.1 * torch.randn(dim, generator=g)).to(device) if affine else None
    grad = torch.randn(rows, dim, generator=g).to(device, dtype)
    leaves = [x.clone().requires_grad_(), u.clone().requires_grad_()]
    leaves += [w.clone().requires_grad_(), b.clone().requires_grad_()] if affine else []
    args = leaves if affine else [*leaves, None, None]
    out = triton_norm.layer_norm_mul_triton(*args, 1e-6)
    grads = torch.autograd.grad(out, leaves, grad)

    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_args = ref_leaves if affine else [*ref_leaves, None, None]
    ref = layer_norm_mul_reference(*ref_args, 1e-6)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == x.shape
    _close(out, ref, tol, "out")
    for name, got, want in zip(["dx", "du", "dweight", "dbias"], grads, ref_grads, strict=False):
        _close(got, want, tol if name in ("dx", "du") else tol * 4, name)


def test_layer_norm_mul_3d_input(device):
    x = torch.randn(5, 3, 16, device=device, requires_grad=True)
    u = torch.randn(5, 3, 16, device=device)
    out = triton_norm.layer_norm_mul_triton(x, u, None, None, 1e-5)
    _close(out, F.layer_norm(x, (16,), eps=1e-5) * u, 1e-5, "out")
    out.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("n,vocab,dim,dtype", [(0, 10, 8, torch.float32), (1, 3, 8, torch.float32),
                                               (200, 17, 40, torch.float32), (64, 5, 32, torch.bfloat16)])
def test_embedding_gather(device, n, vocab, dim, dtype):
    g = torch.Generator().manual_seed(n + vocab)
    table = torch.randn(vocab, dim, generator=g).to(device, dtype).requires_grad_()
    ids = torch.randint(0, vocab, (n,), generator=g).to(device)  # small vocab: many repeated ids
    grad = torch.randn(n, dim, generator=g).to(device, dtype)
    out = triton_embedding.embedding_gather_triton(table, ids)
    (dtable,) = torch.autograd.grad(out, table, grad)
    ref_table = table.detach().float().requires_grad_()
    ref = embedding_gather_reference(ref_table, ids)
    (ref_dtable,) = torch.autograd.grad(ref, ref_table, grad.float())
    assert torch.equal(out, table.detach()[ids])
    _close(dtable, ref_dtable, 1e-6 if dtype == torch.float32 else 1e-2, "dtable")
    assert dtable.dtype == dtype


def test_embedding_gather_rejects_out_of_range_ids(device):
    if device != "cpu":
        pytest.skip("on CUDA the check is a device-side assert, which poisons the process's CUDA context")
    table = torch.randn(4, 8, device=device)
    with pytest.raises(RuntimeError, match="out of range"):
        triton_embedding.embedding_gather_triton(table, torch.tensor([0, 4], device=device))

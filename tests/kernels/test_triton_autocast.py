"""The bf16 training path on CUDA: the fused ops under ``torch.autocast`` against fp32 references.

CUDA autocast does not exist on CPU, so these run only with ``GRSTACK_KERNEL_TEST_DEVICE=cuda`` (the GPU
check, bench/gpu_check.sh, runs tests/kernels that way); on CPU the bf16 kernels themselves are covered in
the interpreter by test_properties.py's dtype cases.
"""

from __future__ import annotations

import pytest
import torch

from grstack.kernels import AttentionInputs, triton_embedding, triton_hstu, triton_norm
from grstack.kernels.reference import hstu_attention_reference

pytestmark = pytest.mark.unit


@pytest.fixture
def cuda(device):
    if device != "cuda":
        pytest.skip("CUDA autocast needs GRSTACK_KERNEL_TEST_DEVICE=cuda and a GPU")
    return torch.device("cuda")


def test_attention_under_autocast_matches_fp32(cuda):
    g = torch.Generator().manual_seed(0)
    lengths = [300, 17, 64, 1]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=cuda)
    n = sum(lengths)
    x = torch.randn(n, 64, generator=g).to(cuda)
    proj = torch.nn.Linear(64, 3 * 2 * 32).to(cuda)
    pos_w = (0.1 * torch.randn(512, generator=g)).to(cuda).requires_grad_()
    ts = torch.cumsum(torch.randint(0, 1000, (n,), generator=g), 0).to(cuda)
    time_w = (0.1 * torch.randn(129, generator=g)).to(cuda).requires_grad_()

    def run(fn, autocast: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            q, k, v = proj(x).view(n, 2, 96).split(32, dim=-1)
            out = fn(AttentionInputs(q, k, v, offsets, max_seq_len=512, timestamps=ts, pos_weight=pos_w,
                                     time_weight=time_w))
        loss = out.float().square().mean()
        grads = torch.autograd.grad(loss, [proj.weight, pos_w, time_w])
        return out, grads

    out, grads = run(triton_hstu.hstu_attention_triton, True)
    assert out.dtype == torch.bfloat16
    ref, ref_grads = run(hstu_attention_reference, False)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=3e-2 * float(want.abs().max()), rtol=5e-2)


def test_norm_and_gather_under_autocast(cuda):
    x = torch.randn(40, 64, device=cuda, requires_grad=True)
    lin = torch.nn.Linear(64, 64).to(cuda)
    table = torch.randn(100, 64, device=cuda, requires_grad=True)
    ids = torch.randint(0, 100, (40,), device=cuda)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        u = lin(x)
        y = triton_norm.layer_norm_mul_triton(x, u, None, None)
        rows = triton_embedding.embedding_gather_triton(table, ids)
    assert u.dtype == torch.bfloat16 and y.dtype == torch.float32 and rows.dtype == torch.float32
    (y.sum() + rows.sum()).backward()
    ref = torch.nn.functional.layer_norm(x.detach(), (64,), eps=1e-6) * u.detach().float()
    torch.testing.assert_close(y.detach(), ref, atol=1e-2, rtol=1e-2)
    assert table.grad.dtype == torch.float32 and x.grad is not None

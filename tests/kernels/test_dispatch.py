"""The kernel dispatcher: argument and environment overrides, device defaults, unknown names."""

from __future__ import annotations

import sys

import pytest
import torch

from grstack import kernels
from grstack.kernels import attention, triton_embedding, triton_hstu, triton_norm

pytestmark = pytest.mark.unit


def test_auto_picks_reference_on_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    assert kernels.select_backend(torch.device("cpu")) == "reference"
    assert kernels.select_backend(torch.device("cuda")) == "triton"
    monkeypatch.setattr(attention, "_triton_available", lambda: False)
    assert kernels.select_backend(torch.device("cuda")) == "reference"


def test_argument_beats_environment_beats_device(monkeypatch):
    monkeypatch.setenv(attention.ENV_VAR, "padded")
    assert kernels.select_backend(torch.device("cpu")) == "padded"
    assert kernels.select_backend(torch.device("cpu"), "triton") == "triton"


@pytest.mark.parametrize("name", ["cudnn", "Triton", ""])
def test_unknown_backend_is_an_error(monkeypatch, name):
    if name:
        with pytest.raises(ValueError, match="unknown kernel backend"):
            kernels.select_backend(torch.device("cpu"), name)
        monkeypatch.setenv(attention.ENV_VAR, name)
        with pytest.raises(ValueError, match=name):
            kernels.hstu_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                                   torch.tensor([0, 1]), max_seq_len=4)
    else:  # an empty variable means "not set"
        monkeypatch.setenv(attention.ENV_VAR, name)
        assert kernels.select_backend(torch.device("cpu")) == "reference"


def _spy(monkeypatch, module, name, calls=None):
    calls = [] if calls is None else calls
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_environment_routes_every_op_to_triton(monkeypatch, jagged_case, device):
    case = jagged_case([3, 0, 9], 2, 16, 16, seed=3, device=device)
    expected = kernels.hstu_attention(case.q, case.k, case.v, case.offsets, max_seq_len=64,
                                      pos_weight=case.pos_weight, backend="reference")
    calls = _spy(monkeypatch, triton_hstu, "hstu_attention_triton")
    _spy(monkeypatch, triton_norm, "layer_norm_mul_triton", calls)
    _spy(monkeypatch, triton_embedding, "embedding_gather_triton", calls)
    monkeypatch.setenv(attention.ENV_VAR, "triton")
    out = kernels.hstu_attention(case.q, case.k, case.v, case.offsets, max_seq_len=64,
                                 pos_weight=case.pos_weight)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 16, device=device)
    kernels.layer_norm_mul(x, x, None, None)
    kernels.embedding_gather(x, torch.tensor([1, 3], device=device))
    assert sorted(calls) == ["embedding_gather_triton", "hstu_attention_triton", "layer_norm_mul_triton"]


def test_padded_backend_matches_reference(jagged_case):
    case = jagged_case([4, 1, 0, 13], 2, 8, 8, seed=4)
    kw = dict(max_seq_len=64, timestamps=case.timestamps, pos_weight=case.pos_weight,
              time_weight=case.time_weight, num_targets=case.num_targets)
    ref = kernels.hstu_attention(case.q, case.k, case.v, case.offsets, backend="reference", **kw)
    pad = kernels.hstu_attention(case.q, case.k, case.v, case.offsets, backend="padded", **kw)
    torch.testing.assert_close(pad, ref, rtol=1e-5, atol=1e-6)


def test_prefix_dispatch(monkeypatch, jagged_case, offsets_of, device):
    case = jagged_case([6, 2], 1, 16, 16, seed=5, device=device)
    pre = torch.tensor([0, 1, 2, 6])
    new = torch.tensor([3, 4, 5, 7])
    args = (case.q[new], case.k[new], case.v[new], offsets_of([3, 1]).to(device), case.k[pre], case.v[pre],
            offsets_of([3, 1]).to(device))
    ref = kernels.hstu_attention_with_prefix(*args, max_seq_len=64, backend="reference")
    calls = _spy(monkeypatch, triton_hstu, "hstu_attention_with_prefix_triton")
    out = kernels.hstu_attention_with_prefix(*args, max_seq_len=64, backend="triton")
    assert calls == ["hstu_attention_with_prefix_triton"]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_npu_backend_needs_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    with pytest.raises(RuntimeError, match="torch_npu"):
        kernels.hstu_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                               torch.tensor([0, 1]), max_seq_len=4, backend="npu")

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


@pytest.mark.parametrize(("backend", "module", "name"), [
    ("reference", attention, "hstu_attention_with_prefix_cpu"),
    ("padded", attention, "hstu_attention_with_prefix_reference"),
    ("triton", triton_hstu, "hstu_attention_with_prefix_triton"),
])
def test_prefix_dispatch_and_layouts(monkeypatch, jagged_case, offsets_of, device, backend, module, name):
    """Each backend runs its own cached-prefix path, on per-sequence K/V in the layout it declares."""
    case = jagged_case([6, 2], 1, 16, 16, seed=5, device=device)
    pre, new = [torch.tensor(x, device=device) for x in ([0, 1, 2, 6], [3, 4, 5, 7])]
    layout = kernels.prefix_layout(torch.device(device), backend)
    assert layout == {"reference": kernels.HEAD_MAJOR, "padded": kernels.TOKEN_MAJOR,
                      "triton": kernels.TOKEN_MAJOR}[backend]

    def per_seq(x):
        return [layout.from_tokens(p) for p in torch.split(x[pre], [3, 1])]

    calls = _spy(monkeypatch, module, name)
    out = kernels.hstu_attention_with_prefix(case.q[new], case.k[new], case.v[new], offsets_of([3, 1]).to(device),
                                             per_seq(case.k), per_seq(case.v), max_seq_len=64,
                                             pos_weight=case.pos_weight, backend=backend)
    assert calls == [name]
    full = kernels.hstu_attention(case.q, case.k, case.v, case.offsets, max_seq_len=64,
                                  pos_weight=case.pos_weight, backend="padded")
    torch.testing.assert_close(out, full[new], rtol=1e-5, atol=1e-5)


def test_prefix_plan_constants_are_reused_and_keyed_by_inputs(jagged_case):
    """A prefix plan memoises the CPU path's masks and bias indices for every layer of one forward, keyed by
    the timestamps and candidate counts (other values: recomputed, never a stale hit)."""
    case = jagged_case([5, 9], 2, 8, 8, seed=4)
    new_offsets = torch.tensor([0, 5, 9])
    kp = [case.k[:0].transpose(0, 1).contiguous(), case.k[5:10].transpose(0, 1).contiguous()]
    vp = [case.v[:0].transpose(0, 1).contiguous(), case.v[5:10].transpose(0, 1).contiguous()]
    pts = [case.timestamps[:0], case.timestamps[5:10]]
    q, k, v = case.q[:9], case.k[:9], case.v[:9]
    plan = kernels.make_prefix_plan([0, 5, 9], [0, 5])
    kw = dict(max_seq_len=64, pos_weight=case.pos_weight, time_weight=case.time_weight, prefix_timestamps=pts,
              num_targets=torch.tensor([2, 1]))

    def run(ts, plan=plan, **extra):
        return kernels.hstu_attention_with_prefix(q, k, v, new_offsets, kp, vp, timestamps=ts, plan=plan,
                                                  backend="reference", **{**kw, **extra})

    ts = case.timestamps[:9].clone()
    a = run(ts)
    entries = len(plan.cache)
    assert torch.equal(run(ts), a) and len(plan.cache) == entries
    shifted = ts * 1000
    assert torch.equal(run(shifted), run(shifted, plan=None)) and not torch.equal(run(shifted), a)
    other_targets = torch.tensor([0, 4])
    assert torch.equal(run(ts, num_targets=other_targets), run(ts, plan=None, num_targets=other_targets))


def test_prefix_op_checks_its_inputs():
    q = torch.zeros(3, 1, 4)
    with pytest.raises(ValueError, match="for 2 sequences"):
        kernels.hstu_attention_with_prefix(q, q, q, torch.tensor([0, 1, 3]), [q], [q], max_seq_len=8)
    with pytest.raises(ValueError, match="prefix_timestamps"):
        kernels.hstu_attention_with_prefix(q, q, q, torch.tensor([0, 3]), [q.transpose(0, 1)], [q.transpose(0, 1)],
                                           max_seq_len=8, timestamps=torch.arange(3), time_weight=torch.zeros(4))


def test_npu_backend_needs_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError
    with pytest.raises(RuntimeError, match="torch_npu"):
        kernels.hstu_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4),
                               torch.tensor([0, 1]), max_seq_len=4, backend="npu")

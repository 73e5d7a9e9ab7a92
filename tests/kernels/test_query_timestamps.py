"""``query_timestamps``: the time bias buckets ``query_ts[i] - ts[j]`` on every backend of both attention ops.

Oracles: an explicit per-element loop for the padded formulation; the padded formulation (plain autograd) for
the grouped reference engine, forward and backward; full attention for the cached-prefix op (each sequence
split at a random prefix length; the prefix's tokens are keys only, the new tokens carry query times).
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack import kernels
from grstack.kernels import grouped

pytestmark = pytest.mark.unit


def _settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def cases(draw, max_len: int = 30) -> dict:
    """A random jagged batch with timestamps and query times that are far from them (so the two bucket
    conventions differ), time bias always on, position bias and candidates drawn."""
    lengths = draw(st.lists(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len)), min_size=1, max_size=4))
    heads, d = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    use_pos, use_targets = draw(st.booleans()), draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = sum(lengths)
    ts = torch.cumsum(torch.randint(0, 100_000, (n,), generator=g), 0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        lengths=lengths,
        offsets=kernels.lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64)),
        q=rand(n, heads, d), k=rand(n, heads, d), v=rand(n, heads, d), timestamps=ts,
        query_timestamps=ts + torch.randint(-50_000, 3_000_000, (n,), generator=g),
        pos_weight=0.5 * rand(16) if use_pos else None, time_weight=0.5 * rand(33),
        num_targets=(torch.tensor([draw(st.integers(0, m)) for m in lengths]) if use_targets else None),
        max_seq_len=16,
    )


def _attention(c: dict, backend: str, query_timestamps: torch.Tensor | None, grad: bool = True):
    """Output and gradients (q, k, v, tables) of ``hstu_attention`` under a fixed output gradient."""
    q, k, v = (c[n].detach().clone().requires_grad_(grad) for n in ("q", "k", "v"))
    tables = [c[n].detach().clone().requires_grad_(grad) if c[n] is not None else None
              for n in ("pos_weight", "time_weight")]
    out = kernels.hstu_attention(q, k, v, c["offsets"], max_seq_len=c["max_seq_len"], timestamps=c["timestamps"],
                                 pos_weight=tables[0], time_weight=tables[1], num_targets=c["num_targets"],
                                 query_timestamps=query_timestamps, backend=backend)
    leaves = [x for x in (q, k, v, *tables) if x is not None]
    if not grad:
        return out, []
    if not out.requires_grad:  # no tokens: a constant (backends differ in whether it tracks gradients)
        return out, [torch.zeros_like(x) for x in leaves]
    # drawn in fp64 then cast, so every backend gets the same output gradient whatever its dtype
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return out, [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)]


def _loop_oracle(c: dict) -> torch.Tensor:
    """The math of the reference docstring, one score at a time."""
    out = torch.zeros_like(c["v"])
    ts, qts, n_buckets = c["timestamps"].tolist(), c["query_timestamps"].tolist(), c["time_weight"].numel() - 1
    offs = c["offsets"].tolist()
    for b in range(len(offs) - 1):
        s0, length = offs[b], offs[b + 1] - offs[b]
        hist = length - (int(c["num_targets"][b]) if c["num_targets"] is not None else 0)
        for i in range(length):
            for j in range(length):
                if j > i or not (j < hist or j == i):
                    continue
                dt = abs(qts[s0 + i] - ts[s0 + j])
                bucket = min(max(math.floor(math.log(max(dt, 1)) / kernels.TIME_BUCKET_DIV), 0), n_buckets)
                bias = c["time_weight"][bucket]
                if c["pos_weight"] is not None:
                    bias = bias + c["pos_weight"][min(max(min(i, hist) - min(j, hist), 0), 15)]
                s = (c["q"][s0 + i] * c["k"][s0 + j]).sum(-1) + bias  # [H]
                out[s0 + i] += (F.silu(s) / c["max_seq_len"])[:, None] * c["v"][s0 + j]
    return out


@_settings(15)
@given(c=cases(max_len=8))
def test_padded_equals_an_explicit_loop(c: dict) -> None:
    got, _ = _attention(c, "padded", c["query_timestamps"], grad=False)
    torch.testing.assert_close(got, _loop_oracle(c), rtol=1e-9, atol=1e-9)


@_settings(40)
@given(c=cases(max_len=60), single_chunk_len=st.sampled_from([16, 128]),
       chunk_elements=st.sampled_from([1 << 9, 1 << 20]))
def test_reference_equals_padded_forward_backward(c: dict, single_chunk_len: int, chunk_elements: int) -> None:
    """The grouped engine (cached bucket indices, causal row chunks, hand-written backward) with query times
    equals plain autograd in fp64, and query times change the result (they are not ignored)."""
    with mock.patch.object(grouped, "SINGLE_CHUNK_LEN", single_chunk_len), \
            mock.patch.object(grouped, "CHUNK_ELEMENTS", chunk_elements):
        got, got_grads = _attention(c, "reference", c["query_timestamps"])
    want, want_grads = _attention(c, "padded", c["query_timestamps"])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for x, y in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9)


def test_query_timestamps_equal_to_timestamps_are_the_default() -> None:
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 7, 7, 19])
    q, k, v = (torch.randn(19, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 10**6, (19,), generator=g), 0)
    kw = dict(max_seq_len=32, timestamps=ts, time_weight=torch.randn(33, generator=g, dtype=torch.float64))
    for backend in ("reference", "padded"):
        base = kernels.hstu_attention(q, k, v, offsets, backend=backend, **kw)
        same = kernels.hstu_attention(q, k, v, offsets, query_timestamps=ts.clone(), backend=backend, **kw)
        shifted = kernels.hstu_attention(q, k, v, offsets, query_timestamps=ts + 10**7, backend=backend, **kw)
        torch.testing.assert_close(same, base, rtol=0, atol=0)
        assert (shifted - base).abs().max() > 1e-3


def test_query_timestamps_need_timestamps_laid_out_alike() -> None:
    x = torch.randn(3, 1, 4)
    offsets = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="need timestamps"):
        kernels.hstu_attention(x, x, x, offsets, max_seq_len=4, query_timestamps=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="laid out like timestamps"):
        kernels.hstu_attention(x, x, x, offsets, max_seq_len=4, timestamps=torch.zeros(3, dtype=torch.int64),
                               query_timestamps=torch.zeros(2, dtype=torch.int64))


@_settings(10)
@given(c=cases(max_len=24))
def test_triton_equals_padded_forward_backward(c: dict) -> None:
    f32 = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in c.items()}
    got, got_grads = _attention(f32, "triton", c["query_timestamps"])
    want, want_grads = _attention(c, "padded", c["query_timestamps"])
    for x, y in zip([got, *got_grads], [want, *want_grads], strict=True):
        torch.testing.assert_close(x.double(), y, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", ["reference", "padded", "triton"])
@_settings(20)
@given(c=cases(max_len=24), data=st.data())
def test_prefix_op_equals_full_attention(backend: str, c: dict, data) -> None:
    """Cached-prefix attention with the new tokens' query times equals their rows of full attention (the
    prefix's tokens' query times play no part: they are keys only)."""
    lengths = c["lengths"]
    nts = c["num_targets"].tolist() if c["num_targets"] is not None else [0] * len(lengths)
    prefix = [data.draw(st.integers(0, n - m)) for n, m in zip(lengths, nts, strict=True)]
    pre, new, start = [], [], 0
    for n, p in zip(lengths, prefix, strict=True):
        pre += range(start, start + p)
        new += range(start + p, start + n)
        start += n
    pre, new = torch.tensor(pre, dtype=torch.int64), torch.tensor(new, dtype=torch.int64)
    new_offsets = kernels.lengths_to_offsets(torch.tensor([n - p for n, p in zip(lengths, prefix, strict=True)]))
    layout = kernels.prefix_layout(torch.device("cpu"), backend)
    per_seq = lambda x: [layout.from_tokens(t) for t in torch.split(x[pre], prefix)]  # noqa: E731
    ts, qts = c["timestamps"], c["query_timestamps"]
    full, _ = _attention(c, "padded", qts, grad=False)
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v = (c[n].to(dtype) for n in ("q", "k", "v"))
    out = kernels.hstu_attention_with_prefix(
        q[new], k[new], v[new], new_offsets, per_seq(k), per_seq(v), max_seq_len=c["max_seq_len"],
        timestamps=ts[new], prefix_timestamps=list(torch.split(ts[pre], prefix)),
        pos_weight=c["pos_weight"].to(dtype) if c["pos_weight"] is not None else None,
        time_weight=c["time_weight"].to(dtype), num_targets=c["num_targets"], query_timestamps=qts[new],
        backend=backend)
    tol = 2e-5 if backend == "triton" else 1e-9
    torch.testing.assert_close(out.double(), full[new], rtol=tol, atol=tol)

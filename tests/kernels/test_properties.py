"""Property tests: every backend of both attention ops against the torch oracles, on random jagged batches.

Batches (hypothesis): 1-4 sequences whose lengths include 0 and 1, random heads and head dims, with and
without the position bias, the time bias and candidates (``num_targets``). Oracles: the dense padded
formulation (``padded`` backend) for full attention, forward and backward; the full-sequence reference for
the cached-prefix op (each sequence split at a random prefix length), forward. Triton runs in the
interpreter on CPU (see conftest), so sizes stay small; ``GRSTACK_KERNEL_TEST_DEVICE=cuda`` runs them on a
GPU instead.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack import kernels
from grstack.kernels import grouped

pytestmark = pytest.mark.unit

DEVICE = os.environ.get("GRSTACK_KERNEL_TEST_DEVICE", "cpu")


def _settings(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Batch:
    """A random jagged attention batch; tensors are made from ``seed`` by :meth:`tensors`."""

    lengths: tuple[int, ...]
    heads: int
    dqk: int
    dv: int
    use_pos: bool
    use_time: bool
    num_targets: tuple[int, ...] | None
    max_seq_len: int
    num_time_buckets: int
    seed: int

    @property
    def offsets(self) -> torch.Tensor:
        return kernels.lengths_to_offsets(torch.tensor(self.lengths, dtype=torch.int64)).to(DEVICE)

    def tensors(self, dtype: torch.dtype = torch.float32, salt: int = 0) -> dict:
        g = torch.Generator().manual_seed(self.seed + salt)
        n = sum(self.lengths)
        gaps = torch.randint(0, 3, (n,), generator=g) * torch.randint(0, 100_000, (n,), generator=g)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)

        return dict(
            q=rand(n, self.heads, self.dqk), k=rand(n, self.heads, self.dqk), v=rand(n, self.heads, self.dv),
            timestamps=torch.cumsum(gaps, 0).to(DEVICE),
            pos_weight=(0.5 * rand(self.max_seq_len)) if self.use_pos else None,
            time_weight=(0.5 * rand(self.num_time_buckets + 1)) if self.use_time else None,
            num_targets=(torch.tensor(self.num_targets, dtype=torch.int64, device=DEVICE)
                         if self.num_targets is not None else None),
        )


@st.composite
def batches(draw, max_len: int = 40, long_len: int | None = None, dims=(8, 16, 24)) -> Batch:
    length = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len))
    lengths = draw(st.lists(length, min_size=1, max_size=4))
    if long_len is not None and draw(st.booleans()):
        lengths.append(draw(st.integers(max_len, long_len)))
    use_targets = draw(st.booleans())
    return Batch(
        lengths=tuple(lengths), heads=draw(st.integers(1, 3)), dqk=draw(st.sampled_from(dims)),
        dv=draw(st.sampled_from(dims)), use_pos=draw(st.booleans()), use_time=draw(st.booleans()),
        num_targets=tuple(draw(st.integers(0, n)) for n in lengths) if use_targets else None,
        # below the longest length, position distances are clamped to the table
        max_seq_len=draw(st.sampled_from([16, 64])), num_time_buckets=draw(st.sampled_from([4, 32])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max abs error within ``tol`` of the expected values' scale (at least 1)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not expected.numel():
        return
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max())
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


def _forward_backward(t: dict, offsets: torch.Tensor, backend: str, dtype: torch.dtype, max_seq_len: int):
    """Output and gradients (q, k, v, pos_w, time_w present) of ``hstu_attention`` under a fixed grad."""
    q, k, v = (t[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
    tables = [t[n].detach().clone().requires_grad_() if t[n] is not None else None
              for n in ("pos_weight", "time_weight")]
    out = kernels.hstu_attention(q, k, v, offsets, max_seq_len=max_seq_len, timestamps=t["timestamps"],
                                 pos_weight=tables[0], time_weight=tables[1], num_targets=t["num_targets"],
                                 backend=backend)
    leaves = [x for x in (q, k, v, *tables) if x is not None]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    if not out.requires_grad:  # nothing to attend to (no tokens): the result is constant zeros
        return out, [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, g.to(out.device, out.dtype), allow_unused=True)
    return out, [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads, strict=True)]


def _grad_names(b: Batch) -> list[str]:
    return ["dq", "dk", "dv"] + ["dpos"] * b.use_pos + ["dtime"] * b.use_time


# -- full attention ------------------------------------------------------------------------------------------

@_settings(60)
@given(b=batches(long_len=200), single_chunk_len=st.sampled_from([16, 128]),
       chunk_elements=st.sampled_from([1 << 10, 1 << 20]))
def test_reference_equals_padded_forward_backward(b: Batch, single_chunk_len: int, chunk_elements: int) -> None:
    """The grouped CPU engine (hand-written backward, causal row chunks) equals plain autograd, in fp64."""
    t = b.tensors(torch.float64)
    with mock.patch.object(grouped, "SINGLE_CHUNK_LEN", single_chunk_len), \
            mock.patch.object(grouped, "CHUNK_ELEMENTS", chunk_elements):
        got = _forward_backward(t, b.offsets, "reference", torch.float64, b.max_seq_len)
    want = _forward_backward(t, b.offsets, "padded", torch.float64, b.max_seq_len)
    for name, x, y in zip(["out", *_grad_names(b)], [got[0], *got[1]], [want[0], *want[1]], strict=True):
        _close(x, y, 1e-9, name)


@_settings(20)
@given(b=batches(), dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
def test_triton_equals_reference_forward_backward(b: Batch, dtype: torch.dtype) -> None:
    """Fused Triton forward and backward against the reference in fp32 on the same (rounded) inputs."""
    t = b.tensors()
    t.update({n: t[n].to(dtype).float() for n in ("q", "k", "v")})  # what both sides see
    out, grads = _forward_backward(t, b.offsets, "triton", dtype, b.max_seq_len)
    assert out.dtype == dtype and out.shape == (sum(b.lengths), b.heads, b.dv)
    want, want_grads = _forward_backward(t, b.offsets, "reference", torch.float32, b.max_seq_len)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for name, x, y in zip(["out", *_grad_names(b)], [out, *grads], [want, *want_grads], strict=True):
        _close(x, y, tol, name)


# -- the cached-prefix op ------------------------------------------------------------------------------------

@st.composite
def prefix_batches(draw) -> tuple[Batch, tuple[int, ...]]:
    """A batch and a prefix length per sequence; candidates are only among the new tokens."""
    b = draw(batches())
    prefix = tuple(draw(st.sampled_from([0, n]) | st.integers(0, n)) for n in b.lengths)
    if b.num_targets is not None:
        nts = tuple(draw(st.integers(0, n - p)) for n, p in zip(b.lengths, prefix, strict=True))
        b = dataclasses.replace(b, num_targets=nts)
    return b, prefix


def _split(b: Batch, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Token indices of the cached prefixes and of the new tokens; the new tokens' lengths."""
    pre, new, new_lengths, start = [], [], [], 0
    for n, p in zip(b.lengths, prefix, strict=True):
        pre += range(start, start + p)
        new += range(start + p, start + n)
        new_lengths.append(n - p)
        start += n
    as_index = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return as_index(pre), as_index(new), new_lengths


@pytest.mark.parametrize("backend", ["reference", "padded", "triton"])
@_settings(25)
@given(case=prefix_batches(), dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
def test_prefix_op_equals_full_attention(backend: str, case: tuple[Batch, tuple[int, ...]],
                                         dtype: torch.dtype) -> None:
    """Every backend's cached-prefix attention equals the new tokens' rows of full attention on the whole
    sequence; one plan serves two layers (different weights), as in a model's forward."""
    b, prefix = case
    pre, new, new_lengths = _split(b, prefix)
    layout = kernels.prefix_layout(torch.device(DEVICE), backend)
    new_offsets = kernels.lengths_to_offsets(torch.tensor(new_lengths)).to(DEVICE)
    plan = kernels.make_prefix_plan(new_offsets, prefix)
    for layer in range(2):
        t = b.tensors(salt=layer)
        q, k, v = (t[n].to(dtype) for n in ("q", "k", "v"))
        ts = t["timestamps"]
        per_seq = lambda x: [layout.from_tokens(p) for p in torch.split(x[pre], list(prefix))]  # noqa: E731
        out = kernels.hstu_attention_with_prefix(
            q[new], k[new], v[new], new_offsets, per_seq(k), per_seq(v), max_seq_len=b.max_seq_len,
            timestamps=ts[new], prefix_timestamps=list(torch.split(ts[pre], list(prefix))),
            pos_weight=t["pos_weight"], time_weight=t["time_weight"], num_targets=t["num_targets"], plan=plan,
            backend=backend)
        assert out.dtype == dtype
        full = kernels.hstu_attention(q.float(), k.float(), v.float(), b.offsets, max_seq_len=b.max_seq_len,
                                      timestamps=ts, pos_weight=t["pos_weight"], time_weight=t["time_weight"],
                                      num_targets=t["num_targets"], backend="padded")
        _close(out, full[new], 2e-5 if dtype == torch.float32 else 3e-2, f"layer {layer}")


# -- the SASRec op and the jagged primitives ----------------------------------------------------------------

@_settings(30)
@given(b=batches(max_len=30))
def test_causal_softmax_attention_equals_per_sequence_sdpa(b: Batch) -> None:
    t = b.tensors()
    q, k, v = t["q"], t["k"], t["v"]
    out = kernels.causal_softmax_attention(q, k, v, b.offsets)
    offs = b.offsets.tolist()
    for i in range(len(b.lengths)):
        s0, s1 = offs[i], offs[i + 1]
        want = F.scaled_dot_product_attention(*(x[s0:s1].transpose(0, 1) for x in (q, k, v)), is_causal=True)
        _close(out[s0:s1], want.transpose(0, 1), 1e-5, f"sequence {i}")


@_settings(50)
@given(lengths=st.lists(st.integers(0, 12), min_size=0, max_size=6), width=st.integers(1, 3))
def test_jagged_primitives(lengths: list[int], width: int) -> None:
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    assert offsets.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert kernels.segment_ids(offsets).tolist() == [b for b, n in enumerate(lengths) for _ in range(n)]
    assert kernels.positions(offsets).tolist() == [i for n in lengths for i in range(n)]
    values = torch.randn(sum(lengths), width)
    if lengths:
        padded = kernels.jagged_to_padded(values, offsets, pad=-1.0)
        assert padded.shape == (len(lengths), max(lengths), width)
        assert int((padded == -1.0).all(-1).sum()) == len(lengths) * max(lengths) - sum(lengths)
        assert torch.equal(kernels.padded_to_jagged(padded, offsets), values)

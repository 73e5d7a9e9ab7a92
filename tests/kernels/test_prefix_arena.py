"""The fused cached-prefix forward reading each sequence's prefix in place from a KV arena (start row + length
in one [T, H, d] tensor per layer; ranges out of order, with gaps), against the full-sequence reference.

Triton runs in the interpreter on CPU (see conftest), so sizes stay small.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack import kernels
from grstack.kernels import attention, triton_hstu

pytestmark = pytest.mark.unit

DEVICE = os.environ.get("GRSTACK_KERNEL_TEST_DEVICE", "cpu")


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol:.1g} * {scale:.3g}"


@st.composite
def arena_cases(draw):
    """Per sequence (prefix length, new length, candidates), the order the prefixes sit in the arena and the
    gap before each."""
    b = draw(st.integers(1, 4))
    seqs = []
    for _ in range(b):
        p, n = draw(st.integers(0, 20)), draw(st.integers(1, 12))
        seqs.append((p, n, draw(st.integers(0, n))))
    order = draw(st.permutations(range(b)))
    gaps = [draw(st.integers(0, 7)) for _ in range(b)]
    return seqs, list(order), gaps, draw(st.booleans()), draw(st.integers(0, 10_000))


def _full_inputs(seqs, seed: int, heads: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    n = sum(p + s for p, s, _ in seqs)
    q, k, v = (torch.randn(n, heads, d, generator=g) for _ in range(3))
    ts = torch.cumsum(torch.randint(0, 3, (n,), generator=g) * torch.randint(0, 50_000, (n,), generator=g), 0)
    return q, k, v, ts


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=arena_cases())
def test_arena_addressed_prefix_equals_full_attention(case) -> None:
    seqs, order, gaps, use_time, seed = case
    max_seq_len, heads, d = 64, 2, 16
    q, k, v, ts = _full_inputs(seqs, seed, heads, d)
    g = torch.Generator().manual_seed(seed + 1)
    pos_w = 0.5 * torch.randn(max_seq_len, generator=g)
    time_w = 0.5 * torch.randn(33, generator=g) if use_time else None
    full_offsets = kernels.lengths_to_offsets(torch.tensor([p + s for p, s, _ in seqs]))
    nts = torch.tensor([c for _, _, c in seqs])
    full = kernels.hstu_attention(q, k, v, full_offsets, max_seq_len=max_seq_len, timestamps=ts, pos_weight=pos_w,
                                  time_weight=time_w, num_targets=nts, backend="padded")
    # the arena: prefixes placed in `order`, each after a gap of garbage rows, plus garbage at the end
    starts = [0] * len(seqs)
    row = 0
    for b in order:
        row += gaps[b]
        starts[b] = row
        row += seqs[b][0]
    total = row + 5
    ka, va = torch.randn(total, heads, d, generator=g), torch.randn(total, heads, d, generator=g)
    tsa = torch.randint(0, 10**9, (total,), generator=g)
    pre, new = [], []
    for b, (p, s, _) in enumerate(seqs):
        first = int(full_offsets[b])
        ka[starts[b]:starts[b] + p] = k[first:first + p]
        va[starts[b]:starts[b] + p] = v[first:first + p]
        tsa[starts[b]:starts[b] + p] = ts[first:first + p]
        pre.append((starts[b], p))
        new += range(first + p, first + p + s)
    new_t = torch.tensor(new, dtype=torch.int64)
    new_offsets = kernels.lengths_to_offsets(torch.tensor([s for _, s, _ in seqs]))
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    ka, va, tsa = dev(ka), dev(va), dev(tsa)
    args = (dev(q[new_t]), dev(k[new_t]), dev(v[new_t]), dev(new_offsets))
    kw = dict(max_seq_len=max_seq_len, timestamps=dev(ts[new_t]), pos_weight=dev(pos_w),
              time_weight=None if time_w is None else dev(time_w), num_targets=dev(nts))
    # 1. the kernel, addressed directly
    out = triton_hstu.hstu_attention_with_prefix_triton(
        kernels.AttentionInputs(*args, **kw), ka, va, prefix_starts=dev(torch.tensor(starts)),
        prefix_lengths=dev(torch.tensor([p for p, *_ in seqs])), prefix_timestamps=tsa)
    _close(out.cpu(), full[new_t], 2e-5, "direct")
    # 2. through the dispatcher, with per-sequence views of the arena: read in place (no concatenation)
    real = triton_hstu.hstu_attention_with_prefix_triton
    with mock.patch.object(triton_hstu, "hstu_attention_with_prefix_triton", wraps=real) as spy:
        out2 = kernels.hstu_attention_with_prefix(
            *args, [ka[s:s + p] for s, p in pre], [va[s:s + p] for s, p in pre], backend="triton",
            prefix_timestamps=[tsa[s:s + p] for s, p in pre], **kw)
    call = spy.call_args
    assert call.kwargs["prefix_starts"] is not None
    live = [b for b, (_, p) in enumerate(pre) if p]
    if live:  # the kernel got the arena's own memory (views), not a concatenated copy
        base_start = min(pre[b][0] for b in live)
        assert call.args[1].data_ptr() == ka[base_start:].data_ptr()
        assert call.args[2].data_ptr() == va[base_start:].data_ptr()
        assert [call.kwargs["prefix_starts"].tolist()[b] for b in live] == [pre[b][0] - base_start for b in live]
    _close(out2.cpu(), full[new_t], 2e-5, "dispatched")


def test_jagged_offsets_call_still_works(jagged_case, device) -> None:
    """Other callers keep passing one concatenated prefix with cumulative offsets."""
    case = jagged_case([6, 9], 2, 16, 16, seed=3, device=device)
    pre, new = [0, 1, 2, 6, 7, 8, 9], [3, 4, 5, 10, 11, 12, 13, 14]
    full = kernels.hstu_attention(case.q.cpu(), case.k.cpu(), case.v.cpu(), case.offsets.cpu(), max_seq_len=64,
                                  pos_weight=case.pos_weight.cpu(), backend="padded")
    pre_t, new_t = torch.tensor(pre, device=device), torch.tensor(new, device=device)
    out = triton_hstu.hstu_attention_with_prefix_triton(
        kernels.AttentionInputs(case.q[new_t], case.k[new_t], case.v[new_t], torch.tensor([0, 3, 8], device=device),
                                max_seq_len=64, pos_weight=case.pos_weight),
        case.k[pre_t], case.v[pre_t], torch.tensor([0, 3, 7], device=device))
    _close(out.cpu(), full[torch.tensor(new)], 2e-5, "jagged")


def test_shared_base_rejects_unrelated_tensors() -> None:
    a, b = torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    assert attention.shared_base([a[1:3], b[0:2]]) is None
    base, starts = attention.shared_base([a[3:5], a.new_zeros(0, 2, 4), a[0:2]])
    assert starts == [3, 0, 0] and base.shape == (5, 2, 4) and base.data_ptr() == a.data_ptr()


def test_serving_engine_on_triton_writes_and_reads_a_token_major_arena(device) -> None:
    """The relay engine on the Triton backend: a chunked prefill written in place into a token-major arena
    and a rank batch read from its views (out of order, with a gap) equal the concatenating path."""
    import numpy as np

    from grstack.runtime.model.hstu import HSTU
    from grstack.runtime.serve.engine import RelayEngine
    from grstack.runtime.serve.kv_arena import ArenaKV, KVArena

    torch.manual_seed(0)
    model = HSTU(50, max_len=40, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                 input_dropout=0.0, time_buckets=16)
    eng = RelayEngine(model, device=device, max_suffix=4, chunk=8, backend="triton")
    arena = KVArena(eng.model, 64, backend=eng.backend)
    assert arena.layout.seq_dim == 0
    rng = np.random.default_rng(0)
    reqs, plain, views = [], [], []
    for n in (20, 9):
        items, ts = rng.integers(1, 51, n + 3), 1_000 + np.cumsum(rng.integers(1, 5000, n + 3))
        reqs.append(eng.canonical(items[:n], ts[:n], items[n:], ts[n:], [1, 2], int(ts[-1]) + 1))
        plain.append(eng.prefill(reqs[-1].long_items, reqs[-1].long_ts))
        arena.alloc(5)
        views.append(eng.prefill(reqs[-1].long_items, reqs[-1].long_ts, arena.prefix(arena.alloc(n))))
        assert isinstance(views[-1], ArenaKV)
        for a, b in zip((*plain[-1].keys, *plain[-1].values), (*views[-1].keys, *views[-1].values), strict=True):
            _close(b.cpu(), a.cpu(), 1e-6, "prefix K/V")
    real = triton_hstu.hstu_attention_with_prefix_triton
    with mock.patch.object(triton_hstu, "hstu_attention_with_prefix_triton", wraps=real) as spy:
        got = eng.rank_cached(views[::-1], reqs[::-1])
    assert spy.call_count == 2 and all(c.kwargs.get("prefix_starts") is not None for c in spy.call_args_list)
    assert all(c.args[1].data_ptr() == arena.keys[i].data_ptr() + 5 * arena.keys[i].stride(0) * 4
               for i, c in enumerate(spy.call_args_list))  # read in place, from the first range (row 5)
    want = eng.rank_cached(plain[::-1], reqs[::-1])
    for g, w in zip(got, want, strict=True):
        _close(g.cpu(), w.cpu(), 2e-5, "scores")

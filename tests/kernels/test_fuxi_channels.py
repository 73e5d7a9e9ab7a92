"""FuXi-α's bias-only attention channels (``kernels.bias_channel_attention``): the grouped jagged formulation
against the dense padded oracle (forward and backward) and a per-pair loop of the paper's formula, every
backend's dispatch, and the cached-prefix variant against the full-sequence rows."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack import kernels

pytestmark = pytest.mark.unit

DEVICE = os.environ.get("GRSTACK_KERNEL_TEST_DEVICE", "cpu")
MAX_SEQ_LEN = 16
BUCKETS = 8


def _case(lengths, heads, dv, use_pos, use_time, with_targets, seed, use_qts=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64)).to(DEVICE)
    gaps = torch.randint(0, 3, (n,), generator=g) * torch.randint(0, 100_000, (n,), generator=g)
    ts = gaps.cumsum(0).to(DEVICE)
    num_targets = (torch.tensor([min(2, length) for length in lengths]).to(DEVICE) if with_targets else None)
    return dict(
        v=torch.randn(n, heads, dv, generator=g).to(DEVICE),
        offsets=offsets,
        pos_weight=torch.randn(MAX_SEQ_LEN, generator=g).to(DEVICE) if use_pos else None,
        time_weight=torch.randn(BUCKETS + 1, generator=g).to(DEVICE) if use_time else None,
        timestamps=ts,
        num_targets=num_targets,
        # query times (FuXi-α's code: the next event's); later than the token's own by 0..10^6 s
        query_timestamps=(ts + torch.randint(0, 10**6, (n,), generator=g).to(DEVICE)) if use_qts else None,
    )


def _run(case, backend, grads=False):
    leaves = {k: case[k].clone().requires_grad_(grads) if case[k] is not None else None
              for k in ("v", "pos_weight", "time_weight")}
    out = kernels.bias_channel_attention(leaves["v"], case["offsets"], max_seq_len=MAX_SEQ_LEN,
                                         pos_weight=leaves["pos_weight"], time_weight=leaves["time_weight"],
                                         timestamps=case["timestamps"], num_targets=case["num_targets"],
                                         query_timestamps=case["query_timestamps"], backend=backend)
    if not grads or case["v"].shape[0] == 0:  # an empty batch's output is a constant
        return out, {}
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device))
    return out, {k: t.grad for k, t in leaves.items() if t is not None}


def _loop_oracle(case):
    """The formula pair by pair: weight = pos_w[pos_i - pos_j] + time_w[bucket(qts_i - ts_j)] where allowed
    (qts = ts without query times)."""
    v, offs = case["v"].cpu(), case["offsets"].tolist()
    pw, tw, ts = case["pos_weight"], case["time_weight"], case["timestamps"].cpu()
    qts = case["query_timestamps"].cpu() if case["query_timestamps"] is not None else ts
    out = torch.zeros_like(v)
    for b in range(len(offs) - 1):
        s0, s1 = offs[b], offs[b + 1]
        hist = (s1 - s0) - (int(case["num_targets"][b]) if case["num_targets"] is not None else 0)
        for i in range(s1 - s0):
            for j in range(i + 1):
                if not (j < hist or j == i):
                    continue
                w = 0.0
                if pw is not None:
                    w += float(pw[min(min(i, hist) - min(j, hist), MAX_SEQ_LEN - 1)])
                if tw is not None:
                    dt = torch.tensor([int(qts[s0 + i]) - int(ts[s0 + j])])
                    w += float(tw[kernels.time_buckets(dt, BUCKETS)[0]])
                out[s0 + i] += w * v[s0 + j]
    return out


cases = st.builds(
    _case,
    lengths=st.lists(st.integers(0, 11), min_size=1, max_size=4),
    heads=st.integers(1, 2),
    dv=st.integers(1, 5),
    use_pos=st.booleans(),
    use_time=st.booleans(),
    with_targets=st.booleans(),
    seed=st.integers(0, 2**16),
    use_qts=st.booleans(),
).filter(lambda c: c["pos_weight"] is not None or c["time_weight"] is not None)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_grouped_equals_the_padded_oracle_forward_and_backward(case):
    want, want_grads = _run(case, "padded", grads=True)
    for backend in ("reference", "triton", "npu"):  # triton: the fused kernels (interpreted on CPU)
        got, got_grads = _run(case, backend, grads=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
def test_matches_the_formula_pair_by_pair(case):
    got, _ = _run(case, "reference")
    torch.testing.assert_close(got.cpu(), _loop_oracle(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "padded", "triton"])  # head-major, token-major, fused
@pytest.mark.parametrize("use_pos,use_time", [(True, False), (False, True), (True, True)])
def test_with_prefix_equals_the_full_sequence_rows(backend, use_pos, use_time):
    case = _case([9, 1, 12, 5], heads=2, dv=3, use_pos=use_pos, use_time=use_time, with_targets=True, seed=4)
    full, _ = _run(case, backend)
    layout = kernels.prefix_layout(case["v"].device, backend)
    offs = case["offsets"].tolist()
    prefix_lens = [4, 0, 10, 3]  # partial, none, the whole history, partial
    v_prefix, pts, rows = [], [], []
    for b, p in enumerate(prefix_lens):
        v_prefix.append(layout.from_tokens(case["v"][offs[b]:offs[b] + p]))
        pts.append(case["timestamps"][offs[b]:offs[b] + p])
        rows += range(offs[b] + p, offs[b + 1])
    rows_t = torch.tensor(rows, device=case["v"].device)
    new_len = torch.tensor([offs[b + 1] - offs[b] - p for b, p in enumerate(prefix_lens)])
    got = kernels.bias_channel_attention_with_prefix(
        case["v"][rows_t], kernels.lengths_to_offsets(new_len).to(case["v"].device), v_prefix,
        max_seq_len=MAX_SEQ_LEN, pos_weight=case["pos_weight"], time_weight=case["time_weight"],
        timestamps=case["timestamps"][rows_t], prefix_timestamps=pts, num_targets=case["num_targets"],
        backend=backend)
    torch.testing.assert_close(got, full[rows_t], rtol=1e-5, atol=1e-5)


def test_query_times_change_only_the_temporal_channel():
    case = _case([7, 3, 9], heads=2, dv=3, use_pos=True, use_time=True, with_targets=True, seed=5, use_qts=True)
    own = dict(case, query_timestamps=None)
    for backend in ("reference", "padded", "triton"):
        assert (_run(case, backend)[0] - _run(own, backend)[0]).abs().max() > 1e-3
        pos_only = dict(case, time_weight=None)
        torch.testing.assert_close(_run(pos_only, backend)[0], _run(dict(pos_only, query_timestamps=None),
                                                                    backend)[0], rtol=0, atol=0)


def test_query_times_need_timestamps_of_their_shape():
    v = torch.zeros(3, 1, 2)
    with pytest.raises(ValueError, match="query_timestamps"):
        kernels.bias_channel_attention(v, torch.tensor([0, 3]), max_seq_len=4, time_weight=torch.zeros(3),
                                       timestamps=torch.arange(3), query_timestamps=torch.arange(2))


def test_a_channel_without_a_bias_is_an_error():
    v = torch.zeros(3, 1, 2)
    with pytest.raises(ValueError, match="pos_weight or time_weight"):
        kernels.bias_channel_attention(v, torch.tensor([0, 3]), max_seq_len=4)


def test_time_channel_needs_prefix_timestamps():
    v = torch.zeros(3, 1, 2)
    with pytest.raises(ValueError, match="prefix_timestamps"):
        kernels.bias_channel_attention_with_prefix(v, torch.tensor([0, 3]), [torch.zeros(1, 0, 2)], max_seq_len=4,
                                                   time_weight=torch.zeros(3), timestamps=torch.arange(3))

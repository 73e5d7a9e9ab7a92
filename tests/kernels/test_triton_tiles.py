"""The fused attention at every tile shape the tuner may pick, with no host syncs and a device tile list.

The interpreter normally runs 16x16 tiles; GPU candidates have unequal query and key tiles (e.g. 64x16,
32x64), which move the boundaries between unmasked and masked key blocks. These tests run the interpreted
kernels at such shapes against the torch reference, forward and backward, with candidates, both biases and
a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from grstack.kernels import AttentionInputs, triton_hstu, triton_tuning
from grstack.kernels.fuxi import bias_channel_attention_reference
from grstack.kernels.host_syncs import HostSyncCount
from grstack.kernels.reference import hstu_attention_reference
from grstack.kernels.triton_util import jagged_tiles

pytestmark = pytest.mark.unit

SHAPES = [triton_tuning.TileConfig(16, 32, 1, 1), triton_tuning.TileConfig(32, 16, 1, 1),
          triton_tuning.TileConfig(16, 16, 1, 1)]


def _batch(lengths, targets, seed=0, heads=2, d=16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    n = int(offsets[-1])
    return dict(
        q=torch.randn(n, heads, d, generator=g, dtype=torch.float64).to(device),
        k=torch.randn(n, heads, d, generator=g, dtype=torch.float64).to(device),
        v=torch.randn(n, heads, d, generator=g, dtype=torch.float64).to(device),
        offsets=offsets.to(device),
        timestamps=torch.cumsum(torch.randint(0, 5000, (n,), generator=g), 0).to(device),
        pos_weight=torch.randn(40, generator=g, dtype=torch.float64).to(device),
        time_weight=torch.randn(33, generator=g, dtype=torch.float64).to(device),
        num_targets=torch.tensor(targets, dtype=torch.int64).to(device),
    )


def _grads(fn, b):
    leaves = {n: b[n].clone().requires_grad_() for n in ("q", "k", "v", "pos_weight", "time_weight")}
    out = fn(AttentionInputs(leaves["q"], leaves["k"], leaves["v"], b["offsets"], max_seq_len=50,
                             timestamps=b["timestamps"], pos_weight=leaves["pos_weight"],
                             time_weight=leaves["time_weight"], num_targets=b["num_targets"]))
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    return out.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda c: f"{c.block_m}x{c.block_n}")
def test_forward_backward_at_tile_shape(shape, monkeypatch, device):
    monkeypatch.setattr(triton_tuning, "INTERPRETER", shape)
    # lengths straddle the tiles; candidates at the end of some sequences; one sequence longer than the
    # position table (clamped distances)
    b = _batch([45, 1, 0, 33, 17], [3, 1, 0, 0, 17], device=device)
    out, grads = _grads(triton_hstu.hstu_attention_triton, b)
    ref_out, ref_grads = _grads(hstu_attention_reference, b)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda c: f"{c.block_m}x{c.block_n}")
def test_prefix_forward_at_tile_shape(shape, monkeypatch, device):
    monkeypatch.setattr(triton_tuning, "INTERPRETER", shape)
    b = _batch([37, 21], [4, 2], seed=3, device=device)
    split = [19, 6]  # cached prefix lengths
    q_rows, prefix_rows = [], []
    for s, n, p in zip(b["offsets"][:-1].tolist(), torch.diff(b["offsets"]).tolist(), split, strict=True):
        prefix_rows.append(torch.arange(s, s + p))
        q_rows.append(torch.arange(s + p, s + n))
    new = torch.cat(q_rows)
    pre = torch.cat(prefix_rows)
    new_off = torch.tensor([0, len(q_rows[0]), len(new)])
    pre_off = torch.tensor([0, split[0], sum(split)])
    inputs = AttentionInputs(b["q"][new], b["k"][new], b["v"][new], new_off, max_seq_len=50,
                             timestamps=b["timestamps"][new], pos_weight=b["pos_weight"],
                             time_weight=b["time_weight"], num_targets=b["num_targets"])
    out = triton_hstu.hstu_attention_with_prefix_triton(inputs, b["k"][pre], b["v"][pre], pre_off,
                                                        prefix_timestamps=b["timestamps"][pre])
    full = hstu_attention_reference(AttentionInputs(b["q"], b["k"], b["v"], b["offsets"], max_seq_len=50,
                                    timestamps=b["timestamps"], pos_weight=b["pos_weight"],
                                    time_weight=b["time_weight"], num_targets=b["num_targets"]))
    torch.testing.assert_close(out, full[new], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("programs", [1, 2], ids=lambda p: f"{p}-programs-per-head")
def test_bounded_table_gradient_partials(programs, monkeypatch, device):
    """The dK/dV kernel's bias-table partials are one row per program, not per (key tile, head): with fewer
    programs than key tiles each program loops over several tiles (read-modify-write of its own row), and
    the gradients still match the reference, for HSTU attention and the bias-only channel."""
    heads = 3
    monkeypatch.setattr(triton_hstu, "PARTIAL_PROGRAMS", programs * heads)
    b = _batch([45, 1, 0, 33, 17, 60], [3, 1, 0, 0, 17, 2], seed=5, heads=heads, device=device)
    num_tiles = jagged_tiles(b["offsets"], int(b["offsets"][-1]), 16)[0].numel()
    assert triton_hstu.partial_programs(num_tiles, heads, True) == programs < num_tiles
    out, grads = _grads(triton_hstu.hstu_attention_triton, b)
    ref_out, ref_grads = _grads(hstu_attention_reference, b)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=2e-5, rtol=1e-4, msg=name)
    again = _grads(triton_hstu.hstu_attention_triton, b)[1]
    assert all(torch.equal(again[n], grads[n]) for n in ("pos_weight", "time_weight"))  # fixed order, no atomics

    for tables in (dict(pos_weight="pos_weight"), dict(time_weight="time_weight", timestamps="timestamps")):
        def channel(fn, tables=tables):
            leaves = {n: b[n].clone().requires_grad_() for n in ("v", *[t for t in tables if t != "timestamps"])}
            kw = {k: leaves[k] if k in leaves else b[v] for k, v in tables.items()}
            o = fn(AttentionInputs.channel(leaves["v"], b["offsets"], max_seq_len=50, num_targets=b["num_targets"],
                                           **kw))
            o.backward(torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape))
            return o.detach(), {n: t.grad for n, t in leaves.items()}

        got, got_grads = channel(triton_hstu.bias_channel_triton)
        want, want_grads = channel(bias_channel_attention_reference)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        for name in got_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], atol=2e-5, rtol=1e-4, msg=name)


def test_partial_bytes_do_not_grow_with_tiles():
    """At the 0.2B config's shape (8 heads, a 4,097-entry position table, 129 time buckets) the partials stay
    under ``PARTIAL_PROGRAMS`` rows however many key tiles a batch has."""
    heads, num_pos, num_tb = 8, 4097, 128
    sizes = [triton_hstu.partial_bytes(triton_hstu.partial_programs(tiles, heads, True), heads, num_pos, num_tb,
                                       True, True) for tiles in (200, 1_631, 100_000)]
    assert sizes[1] == sizes[2] <= triton_hstu.PARTIAL_PROGRAMS * 4 * (3 * num_pos + 2 + 256)
    assert triton_hstu.partial_programs(1_631, heads, False) == 1_631  # no partials: one program per tile


def test_forward_backward_make_no_host_sync(device):
    """Nothing in a forward+backward blocks the host: no ``.cpu()/.item()/.tolist()``, and no implicit sync
    either (``int(t)``, bool masks, ``nonzero``...: :mod:`grstack.kernels.host_syncs`)."""
    b = _batch([20, 3, 9], [2, 0, 1], device=device)
    with HostSyncCount(device) as counter:
        _grads(triton_hstu.hstu_attention_triton, b)
    assert counter.count == 0, dict(counter.by_kind)


def test_tile_list_covers_every_token_once():
    lengths = [0, 5, 33, 1, 16, 17]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    seq, blk = jagged_tiles(offsets, sum(lengths), 16)
    assert seq.numel() == sum(lengths) // 16 + len(lengths)  # the host-known size
    real = seq >= 0
    tiles = sorted(zip(seq[real].tolist(), blk[real].tolist(), strict=True))
    expected = sorted((b, i) for b, n in enumerate(lengths) for i in range((n + 15) // 16))
    assert tiles == expected
    # longest sequence first, padding tiles last
    assert seq[0].item() == 2 and not real[real.sum():].any()


def test_tuner_caches_per_key_and_honours_the_switch(monkeypatch):
    tried = []
    monkeypatch.setattr(triton_tuning, "_tune", lambda options, launch: tried.append(options) or options[-1])
    monkeypatch.setattr(triton_tuning, "_chosen", {})
    launched = []
    key = triton_tuning.TuneKey("fwd", "torch.bfloat16", 64, 64, 4, ("HAS_POS",), 4096)
    first = triton_tuning.run_tuned(key, False, launched.append)
    again = triton_tuning.run_tuned(key, False, launched.append)
    assert first == again == triton_tuning.candidates("fwd", 64)[-1] and len(tried) == 1
    assert launched == [first, first]
    monkeypatch.setenv(triton_tuning.ENV_AUTOTUNE, "0")
    other = triton_tuning.TuneKey("fwd", "torch.bfloat16", 128, 128, 4, (), 4096)
    assert triton_tuning.run_tuned(other, False, launched.append) == triton_tuning.candidates("fwd", 128)[0]
    assert len(tried) == 1
    assert triton_tuning.max_len_bucket(3000) == 4096 and triton_tuning.max_len_bucket(1) == 1

"""The fused attention at every tile shape the tuner may pick, with no host syncs and a device tile list.

The interpreter normally runs 16x16 tiles; GPU candidates have unequal query and key tiles (e.g. 64x16,
32x64), which move the boundaries between unmasked and masked key blocks. These tests run the interpreted
kernels at such shapes against the torch reference, forward and backward, with candidates, both biases and
a cached prefix.
"""

from __future__ import annotations

import pytest
import torch

from grstack.kernels import triton_hstu, triton_tuning
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
    out = fn(leaves["q"], leaves["k"], leaves["v"], b["offsets"], max_seq_len=50, timestamps=b["timestamps"],
             pos_weight=leaves["pos_weight"], time_weight=leaves["time_weight"], num_targets=b["num_targets"])
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
    kw = dict(max_seq_len=50, timestamps=b["timestamps"][new], prefix_timestamps=b["timestamps"][pre],
              pos_weight=b["pos_weight"], time_weight=b["time_weight"], num_targets=b["num_targets"])
    out = triton_hstu.hstu_attention_with_prefix_triton(b["q"][new], b["k"][new], b["v"][new], new_off,
                                                        b["k"][pre], b["v"][pre], pre_off, **kw)
    full = hstu_attention_reference(b["q"], b["k"], b["v"], b["offsets"], max_seq_len=50,
                                    timestamps=b["timestamps"], pos_weight=b["pos_weight"],
                                    time_weight=b["time_weight"], num_targets=b["num_targets"])
    torch.testing.assert_close(out, full[new], atol=2e-5, rtol=1e-4)


def test_forward_backward_make_no_host_sync(monkeypatch, device):
    """No ``.cpu()``, ``.item()`` or ``.tolist()`` in a forward+backward (each would block on a GPU)."""
    b = _batch([20, 3, 9], [2, 0, 1], device=device)
    calls = []
    def counting(name):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return orig(self, *args, **kwargs)
        return wrapper

    for name in ("cpu", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    _grads(triton_hstu.hstu_attention_triton, b)
    monkeypatch.undo()
    assert calls == []


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

"""FuXi-α on jagged batches: shapes, gradients, causality, candidate isolation, its channels, exact relay
serving (cached prefix), the exported artefact, and a `grstack train` / `grstack eval` round trip."""

import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from grstack import kernels
from grstack.runtime.cli import main
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.model import FuXiAlpha, build_model
from grstack.runtime.model.hstu import next_event_timestamps
from grstack.runtime.training_config import ModelConfig

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


def _batch(lengths, num_items=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths))
    n = int(offsets[-1])
    return JaggedBatch(item_ids=torch.randint(1, num_items + 1, (n,), generator=g), offsets=offsets,
                       timestamps=torch.randint(0, 10**6, (n,), generator=g).sort().values)


def _model(**kw) -> FuXiAlpha:
    args = dict(max_len=40, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=4, dropout=0.0, input_dropout=0.0)
    args.update(kw)
    model = FuXiAlpha(50, **args).eval()
    with torch.no_grad():  # visible biases (they start at N(0, 0.02))
        for layer in model.layers:
            for w in (layer.pos_weight, layer.time_weight):
                if w is not None:
                    w.normal_(0.0, 0.5)
    return model


def test_build_model_makes_fuxi_and_every_parameter_gets_a_gradient():
    model = build_model(ModelConfig(type="fuxi", d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, ffn_mult=2),
                        num_items=50, max_len=20, num_tasks=2)
    assert isinstance(model, FuXiAlpha)
    layer = model.layers[0]
    # U gates the three channels (3·H·dv), V is shared (H·dv); the SwiGLU's hidden width is ffn_mult·d
    assert layer.uvqk.weight.shape == (3 * 2 * 8 + 2 * 8 + 2 * 2 * 8, 16)
    assert layer.lin0.weight.shape == (16, 3 * 2 * 8) and layer.lin1.weight.shape == (32, 16)
    batch = _batch([5, 1, 12, 3])
    out = model.encode(batch)
    assert out.shape == (21, 16)
    full, is_hist = append_candidates(batch, torch.randint(1, 51, (4, 3)), torch.full((4,), 10**6))
    cand_out = model.encode(full)[~is_hist]
    loss = (model.query_vectors(out).sum() + model.item_vectors(batch.item_ids).sum()
            + model.rank_logits(cand_out, full.item_ids[~is_hist]).sum())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or not p.grad.abs().sum() > 0]
    assert not missing


def test_outputs_are_causal_and_candidates_isolated():
    model = _model()
    batch = _batch([9, 6])
    prefix = JaggedBatch(item_ids=torch.cat([batch.item_ids[:5], batch.item_ids[9:12]]),
                         offsets=torch.tensor([0, 5, 8]),
                         timestamps=torch.cat([batch.timestamps[:5], batch.timestamps[9:12]]))
    with torch.no_grad():
        out = model.encode(batch)
        torch.testing.assert_close(out[torch.tensor([0, 1, 2, 3, 4, 9, 10, 11])], model.encode(prefix),
                                   rtol=1e-5, atol=1e-6)
        ts = torch.full((2,), 2 * 10**6)
        full, is_hist = append_candidates(batch, torch.tensor([[1, 2, 3], [4, 5, 6]]), ts)
        got = model.encode(full)
        torch.testing.assert_close(got[is_hist], out, rtol=1e-5, atol=1e-6)
        other = model.encode(append_candidates(batch, torch.tensor([[1, 9, 9], [4, 9, 9]]), ts)[0])
        first = torch.tensor([9, 18])  # each user's first candidate: the same whatever the others are
        torch.testing.assert_close(got[first], other[first], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("time_bias", [True, False])
def test_the_temporal_channel_reads_timestamps_only_when_on(time_bias):
    model = _model(time_bias=time_bias)
    assert model.layers[0].num_channels == (3 if time_bias else 2)
    batch = _batch([8, 5])
    shifted = JaggedBatch(item_ids=batch.item_ids, offsets=batch.offsets,
                          timestamps=batch.timestamps * torch.arange(1, 14))  # other gaps, same order
    with torch.no_grad():
        changed = not torch.allclose(model.encode(batch), model.encode(shifted))
    assert changed == time_bias


@pytest.mark.parametrize("backend", ["reference", "padded"])  # head-major and token-major prefix K/V
def test_encode_with_prefix_equals_encode_on_the_whole_sequences(backend):
    """Relay inference: per-layer K/V of each prefix prefilled in chunks, then the new tokens (history
    suffix + candidates) against them, equal encode()'s rows for those tokens."""
    torch.manual_seed(0)
    model = _model()
    assert model.kv_elements_per_token == 2 * 2 * (8 + 4)  # K and V of the semantic channel only
    with torch.no_grad():
        batch = _batch([9, 1, 14, 6], seed=3)
        cands = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]])
        full, _ = append_candidates(batch, cands, torch.full((4,), 2 * 10**6))
        want = model.encode(full)
        prefix_lens = [4, 0, 14, 5]  # a whole history cached, none, and partial ones
        offs = full.offsets.tolist()
        keys, values, pts, new_rows = [], [], [], []
        for b, p in enumerate(prefix_lens):
            s0 = offs[b]
            k, v = None, None
            for c0 in range(0, p, 3):  # prefill in chunks of 3 tokens
                c1 = min(p, c0 + 3)
                k, v = model.prefill_kv(full.item_ids[s0 + c0:s0 + c1], full.timestamps[s0 + c0:s0 + c1], k, v,
                                        full.timestamps[s0:s0 + c0], backend=backend)
            if k is None:
                k, v = model.empty_prefix_kv(backend)
            keys.append(k)
            values.append(v)
            pts.append(full.timestamps[s0:s0 + p])
            new_rows += range(s0 + p, offs[b + 1])
        new_rows = torch.tensor(new_rows)
        new_lengths = torch.tensor([offs[b + 1] - offs[b] - p for b, p in enumerate(prefix_lens)])
        got, _, _ = model.encode_with_prefix(full.item_ids[new_rows], full.timestamps[new_rows],
                                             kernels.lengths_to_offsets(new_lengths), keys, values, pts,
                                             num_targets=full.num_targets, backend=backend)
    torch.testing.assert_close(got, want[new_rows], rtol=1e-5, atol=1e-5)


def test_train_then_eval_rebuilds_the_exported_fuxi(tmp_path, capsys):
    run = tmp_path / "run"
    overrides = ["model.type=fuxi", "train.max_steps=4", "train.num_threads=1"]
    assert main(["train", "--config", str(TINY), "--out", str(run), "--no-progress",
                 *[part for o in overrides for part in ("--set", o)]]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == "fuxi" and summary["steps"] == 4
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--split", "test", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["model"] == "fuxi"
    for k in ("hr@10", "ndcg@10"):
        assert got["metrics"]["test"][k] == pytest.approx(summary["metrics"]["test"][k], abs=1e-9)


def test_next_time_bias_reaches_the_temporal_channel_only():
    """FuXi-α's code buckets the gap from each key event to the event being predicted (``time_bias_query=next``):
    the temporal channel gets HSTU's next-event query times, the positional channel none, and the outputs move."""
    assert ModelConfig(type="fuxi", time_bias_query="next").time_bias_query == "next"
    g = torch.Generator().manual_seed(3)
    lengths = [6, 1, 9]
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths))
    batch = JaggedBatch(item_ids=torch.randint(1, 51, (16,), generator=g), offsets=offsets,
                        timestamps=torch.randint(0, 10**8, (16,), generator=g).sort().values)
    seen: list = []
    real = kernels.bias_channel_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("time_weight") is not None, kwargs.get("query_timestamps")))
        return real(*args, **kwargs)

    def model(query: str) -> FuXiAlpha:
        torch.manual_seed(0)
        return FuXiAlpha(50, max_len=20, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=8, dropout=0.0,
                         input_dropout=0.0, time_bias_query=query).eval()

    want = next_event_timestamps(batch.timestamps, offsets)
    with torch.no_grad(), mock.patch.object(kernels, "bias_channel_attention", spy):
        nxt = model("next").encode(batch)
        assert [t for t, _ in seen] == [False, True, False, True]  # positional, temporal per block
        assert all(q is None for t, q in seen if not t) and all(q.tolist() == want.tolist() for t, q in seen if t)
        seen.clear()
        own = model("self").encode(batch)
        assert all(q is None for _, q in seen)
    assert (nxt - own).abs().max() > 1e-4
    assert not model("next").cached_prefix_exact and model("self").cached_prefix_exact



_TRITON_PATH_CHECK = """
import json
import os
import torch
from grstack import kernels
from grstack.kernels import HostSyncCount
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.model import FuXiAlpha

g = torch.Generator().manual_seed(0)
offsets = kernels.lengths_to_offsets(torch.tensor([5, 1, 12, 3, 0, 17]))
n = int(offsets[-1])
batch = JaggedBatch(item_ids=torch.randint(1, 51, (n,), generator=g), offsets=offsets,
                    timestamps=torch.randint(0, 10**6, (n,), generator=g).sort().values)
model = FuXiAlpha(50, max_len=40, d_model=16, num_blocks=2, num_heads=2, dqk=8, dv=4, dropout=0.0,
                  input_dropout=0.0).eval()
with torch.no_grad():
    for layer in model.layers:
        layer.pos_weight.normal_(0.0, 0.5)
        layer.time_weight.normal_(0.0, 0.5)
built = []
make_plan = kernels.make_plan
kernels.make_plan = lambda *a, **k: built.append(1) or make_plan(*a, **k)
out = {}
with torch.no_grad():
    for backend in ("reference", "triton"):
        os.environ[kernels.ENV_VAR] = backend
        with HostSyncCount("cpu") as syncs:
            y = model.encode(batch)
        out[backend] = {"plans": len(built), "syncs": dict(syncs.by_kind), "y": y.tolist()}
print(json.dumps(out))
"""


def test_the_triton_path_builds_no_plan_and_reads_nothing_back():
    """The fused kernels need no length-group plan: FuXi-α builds none there (no host read of the offsets,
    no copies) and its outputs equal the grouped engine's, which builds one (from the batch's host lengths:
    no read either). In a subprocess:
    the kernels must be interpreted from their first import (``TRITON_INTERPRET=1``)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-P", "-c", _TRITON_PATH_CHECK], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["reference"]["plans"] == 1 and out["reference"]["syncs"] == {}
    assert out["triton"]["plans"] == 1 and out["triton"]["syncs"] == {}  # no new plan, nothing read back
    torch.testing.assert_close(torch.tensor(out["triton"]["y"]), torch.tensor(out["reference"]["y"]),
                               atol=1e-5, rtol=1e-4)

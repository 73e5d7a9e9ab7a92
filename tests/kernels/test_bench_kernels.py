"""`grstack bench kernels`: one JSON object with the documented fields; user mistakes are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from grstack.runtime import cli
from grstack.runtime.bench import kernels as bench

pytestmark = pytest.mark.unit


def test_bench_prints_one_json_object(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_cases", lambda device, quick, seed: iter(
        [("kuairand-like", [3, 1, 17, 5]), ("fixed-16", [16, 16])]))
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "kernels", "--quick", "--json", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    result = json.loads(out)  # exactly one JSON document on stdout
    assert [c["name"] for c in result["cases"]] == ["kuairand-like", "fixed-16"]
    for case in result["cases"]:
        assert {"name", "device", "backend", "lengths", "jagged_ms", "padded_ms", "speedup", "jagged_peak_bytes",
                "padded_peak_bytes"} <= set(case)
        assert case["device"] == "cpu" and case["backend"] == "reference"
        assert case["jagged_ms"] > 0 and case["padded_ms"] > 0
        assert case["jagged_peak_bytes"] > 0 and case["padded_peak_bytes"] > 0
        assert case["max_abs_diff"] < 1e-5 and case["max_abs_diff_naive"] < 1e-5
        assert case["padded_naive_ms"] > 0 and case["host_syncs"] == 0
    assert result["cases"][0]["lengths"] == {"batch": 4, "tokens": 26, "mean": 6.5, "max": 17}
    variants = result["cases"][0]["variants"]
    assert [(v["bias"], v["table_grads"], v["backward"]) for v in variants] == [
        (True, False, True), (False, False, True), (True, False, False), (False, False, False)]
    assert all(v["jagged_ms"] > 0 and v["padded_ms"] > 0 for v in variants)
    assert "memory_method" in result and result["quick"] is True
    assert "TorchDispatchMode" in result["host_syncs_counter"]  # the figure says how it was counted


def test_padded_memory_exceeds_jagged_on_a_skewed_batch(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_cases", lambda device, quick, seed: iter([("skewed", [200] + [2] * 31)]))
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "kernels", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    case, case64 = json.loads(capsys.readouterr().out)["cases"]
    assert (case["name"], case["d"], case64["name"], case64["d"]) == ("skewed", 16, "skewed@d64", 64)
    # padded holds [32, H, 200, 200] score tensors; jagged only [1, H, 200, 200] and tiny blocks
    assert case["padded_peak_bytes"] > 5 * case["jagged_peak_bytes"]


def test_flop_count_is_over_causal_pairs():
    assert bench.attention_flops([1, 3], heads=2, dqk=4, dv=8) == (1 + 6) * 2 * 6 * 12


def test_cuda_without_a_gpu_is_a_user_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "kernels", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: --device cuda")


def test_the_good_padded_baseline_has_the_naive_ones_gradients():
    g = torch.Generator().manual_seed(1)
    inp = bench._inputs([5, 9, 2], "cpu", torch.float64, 2, 4, 4, 10, seed=1)
    grads = {}
    for impl in ("padded", "padded_naive"):
        q, k, v = (inp[n].detach().requires_grad_() for n in ("q", "k", "v"))
        pw, tw = inp["pos_weight"].double().requires_grad_(), inp["time_weight"].double().requires_grad_()
        if impl == "padded":
            out = bench._padded_good(q, k, v, inp, bench.padded_prep(inp), pw, tw)
        else:
            from grstack.kernels import hstu_attention

            out = hstu_attention(q, k, v, inp["offsets"], backend="padded", max_seq_len=10,
                                 timestamps=inp["timestamps"], pos_weight=pw, time_weight=tw)
        out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
        grads[impl] = [t.grad for t in (q, k, v, pw, tw)]
        g = torch.Generator().manual_seed(1)
    for a, b in zip(grads["padded"], grads["padded_naive"], strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_host_syncs_are_counted_and_the_methods_restored():
    before = torch.Tensor.tolist
    assert bench.count_host_syncs(lambda: (torch.ones(2).tolist(), torch.ones(1).item(), torch.ones(1).cpu())) == 3
    t = torch.arange(4)
    assert bench.count_host_syncs(lambda: (int(t[0]), t[t > 1], t.nonzero())) == 3  # the implicit ones too
    assert torch.Tensor.tolist is before

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
        assert case["max_abs_diff"] < 1e-5
    assert result["cases"][0]["lengths"] == {"batch": 4, "tokens": 26, "mean": 6.5, "max": 17}
    assert "memory_method" in result and result["quick"] is True


def test_padded_memory_exceeds_jagged_on_a_skewed_batch(monkeypatch, capsys):
    monkeypatch.setattr(bench, "_cases", lambda device, quick, seed: iter([("skewed", [200] + [2] * 31)]))
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "kernels", "--reps", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    # padded holds [32, H, 200, 200] score tensors; jagged only [1, H, 200, 200] and tiny blocks
    assert case["padded_peak_bytes"] > 5 * case["jagged_peak_bytes"]


def test_flop_count_is_over_causal_pairs():
    assert bench.attention_flops([1, 3], heads=2, dqk=4, dv=8) == (1 + 6) * 2 * 6 * 12


def test_cuda_without_a_gpu_is_a_user_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "kernels", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("error: --device cuda")

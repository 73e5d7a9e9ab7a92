"""``bench relay-engine``: one small run on CPU produces every field, arena and plain paths agree, and cached
scores equal full inference."""

import json

import pytest

from grstack.runtime.cli import main

pytestmark = pytest.mark.integration


def test_relay_engine_bench_reports_each_length(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "relay-engine", "--device", "cpu", "--lengths", "64,200", "--batch", "3",
                 "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu" and [c["length"] for c in out["cases"]] == [64, 200]
    for c in out["cases"]:
        assert c["batch"] == 3 and c["prefill_ms"] > 0 and c["rank_cached_batch_arena_ms"] > 0
        assert c["arena_vs_plain_max_abs_diff"] == 0.0  # views of the arena are the same numbers
        assert c["max_abs_score_diff"] is not None and c["max_abs_score_diff"] <= 1e-5
        assert c["peak_bytes_prefill"] is None  # device memory is reported on CUDA only


def test_bad_flags_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "relay-engine", "--lengths", "64,x"]) == 2
    assert "--lengths" in capsys.readouterr().err

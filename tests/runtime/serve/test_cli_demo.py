"""``grstack serve local`` as a user runs it, the demo's serving leg, and CLI mistakes as one-line errors."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from grstack_testing import write_cyclic

from grstack.runtime.cli import main

pytestmark = pytest.mark.timeout(180)


@pytest.mark.integration
def test_serve_local_starts_serves_and_stops(tiny_checkpoint: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-P", "-m", "grstack.runtime.cli", "serve", "local", "--checkpoint",
                             str(tiny_checkpoint), "--replicas", "1", "--port", "0", "--length-threshold", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["url"].startswith("http://127.0.0.1:")
        assert len(ready["rankers"]) == 1 and ready["rankers"][0].startswith("http://127.0.0.1:")
        body = {"user_id": "cli", "long_term": {"items": [1, 2, 3, 4, 5], "timestamps": [1, 2, 3, 4, 5]},
                "short_term": {"items": [6], "timestamps": [6]}, "candidates": [7, 8]}

        def post(path: str, data: dict) -> dict:
            req = urllib.request.Request(ready["url"] + path, data=json.dumps(data).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())

        pre = post("/v1/prefill", {"user_id": "cli", "long_term": body["long_term"], "wait": True})
        assert pre["admitted"] and pre["ranker"]["status"] == "computed"
        out = post("/v1/rank", body)
        assert out["cache"] == "device" and len(out["scores"]) == 2 and out["tasks"] == ["next", "click"]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


@pytest.mark.integration
def test_serve_demo_reports_latency_hits_and_exactness(tiny_checkpoint: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from grstack.runtime.serve.demo import serve_demo

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_checkpoint, run / "model.pt")
    write_cyclic(run / "dataset", num_users=40, num_items=60, min_len=14, max_len=40)
    report = serve_demo(run, replicas=2, requests=40, qps=40.0)
    assert report["requests"] == report["ok"] == 40 and report["errors"] == 0
    assert report["prefills_admitted"] > 0 and report["hit_rate"] > 0
    assert sum(report["cache"].values()) == 40
    assert report["max_abs_score_diff"] <= 1e-5
    assert 0.0 <= report["hr@1"] <= 1.0 and report["p99_ms"] >= report["p50_ms"] > 0
    out = capsys.readouterr().out
    assert "40/40 rank requests answered, 0 errors" in out and "prefix cache hits" in out


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "ranker", "--checkpoint", "/nonexistent/model.pt"], "checkpoint /nonexistent/model.pt not found"),
    (["serve", "local", "--checkpoint", "/nonexistent", "--replicas", "0"], "--replicas: 0 is out of range"),
    (["serve", "router", "--rankers", "http://127.0.0.1:1", "--slo-ms", "0"], "--slo-ms: 0 is out of range"),
])
def test_cli_mistakes_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.unit
def test_cli_rejects_a_suffix_budget_the_model_cannot_hold(tiny_checkpoint: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "ranker", "--checkpoint", str(tiny_checkpoint), "--max-suffix", "48"]) == 2
    assert "--max-suffix 48" in capsys.readouterr().err

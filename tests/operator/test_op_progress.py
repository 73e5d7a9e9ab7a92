"""Rank 0's progress reporter: cheap to import, a no-op unless configured, throttled, never fatal."""

from __future__ import annotations

import http.server
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from grstack.runtime.train import progress


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[tuple[str, str, dict[str, Any]]]

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, self.headers["Content-Type"], body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def _env(monkeypatch: pytest.MonkeyPatch, url: str, interval: str = "3600") -> None:
    monkeypatch.setenv("GRSTACK_PROGRESS_ANNOTATION", "grstack.io/progress")
    monkeypatch.setenv("GRSTACK_POD_NAME", "demo-worker-0")
    monkeypatch.setenv("GRSTACK_POD_NAMESPACE", "team-a")
    monkeypatch.setenv("GRSTACK_PROGRESS_INTERVAL", interval)
    monkeypatch.setenv("GRSTACK_KUBE_API", url)


def _wait(predicate: Any, what: str) -> None:
    for _ in range(300):
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.unit
def test_import_is_cheap() -> None:
    code = ("import sys; from grstack.runtime.train.progress import report_progress; "
            "report_progress({'step': 1}); "
            "print(sorted(m for m in ('kubernetes', 'urllib.request', 'ssl', 'torch', 'aiohttp') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


@pytest.mark.unit
def test_disabled_without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GRSTACK_PROGRESS_ANNOTATION", "GRSTACK_POD_NAME", "GRSTACK_POD_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    assert progress.PodAnnotationReporter.from_env("GRSTACK_PROGRESS_ANNOTATION") is None


@pytest.mark.integration
def test_patches_own_pod_annotation_with_throttling(monkeypatch: pytest.MonkeyPatch,
                                                    api: http.server.ThreadingHTTPServer) -> None:
    _env(monkeypatch, f"http://127.0.0.1:{api.server_port}")
    reporter = progress.PodAnnotationReporter.from_env("GRSTACK_PROGRESS_ANNOTATION")
    assert reporter is not None
    for step in range(1, 50):
        reporter.submit({"step": step, "loss": 1.0 / step}, urgent=False)
    _wait(lambda: len(api.requests) >= 1, "the first report")
    time.sleep(0.2)
    assert len(api.requests) == 1  # the rest waits for the (one hour) interval
    reporter.submit({"step": 50, "last_checkpoint": "/run/checkpoints/step-50"}, urgent=True)
    _wait(lambda: len(api.requests) == 2, "the checkpoint report, sent at once")
    path, content_type, body = api.requests[-1]
    assert path == "/api/v1/namespaces/team-a/pods/demo-worker-0"
    assert content_type == "application/merge-patch+json"
    report = json.loads(body["metadata"]["annotations"]["grstack.io/progress"])
    assert report["step"] == 50 and report["last_checkpoint"] == "/run/checkpoints/step-50"
    assert report["loss"] == pytest.approx(1 / 49)  # fields merge across reports
    reporter.submit({"step": 51}, urgent=False)
    reporter.flush()
    assert json.loads(api.requests[-1][2]["metadata"]["annotations"]["grstack.io/progress"])["step"] == 51


@pytest.mark.integration
def test_odd_values_do_not_break_reporting(monkeypatch: pytest.MonkeyPatch,
                                           api: http.server.ThreadingHTTPServer) -> None:
    _env(monkeypatch, f"http://127.0.0.1:{api.server_port}")
    reporter = progress.PodAnnotationReporter.from_env("GRSTACK_PROGRESS_ANNOTATION")
    reporter.submit({"step": 1, "last_checkpoint": Path("/run/checkpoints/step-1")}, urgent=True)
    reporter.flush()
    _wait(lambda: api.requests, "a report")
    report = json.loads(api.requests[-1][2]["metadata"]["annotations"]["grstack.io/progress"])
    assert report["last_checkpoint"] == "/run/checkpoints/step-1"


@pytest.mark.unit
def test_unreachable_api_warns_once_and_never_raises(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    _env(monkeypatch, "http://127.0.0.1:9", interval="0")
    reporter = progress.PodAnnotationReporter.from_env("GRSTACK_PROGRESS_ANNOTATION")
    with caplog.at_level(logging.WARNING, logger="grstack.progress"):
        for step in range(5):
            reporter.submit({"step": step}, urgent=True)
            reporter.flush(timeout=0.5)
        _wait(lambda: reporter.error_count >= 5, "failed attempts")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "training continues" in warnings[0].getMessage()


@pytest.mark.integration
def test_final_report_is_flushed_at_exit(api: http.server.ThreadingHTTPServer) -> None:
    code = ("from grstack.runtime.train.progress import report_progress\n"
            "report_progress({'step': 1})\n"
            "report_progress({'step': 9, 'finished': True, 'metrics': {'ndcg@10': 0.25}})\n")
    env = {"PATH": "/usr/bin:/bin", "GRSTACK_PROGRESS_ANNOTATION": "grstack.io/progress",
           "GRSTACK_POD_NAME": "p", "GRSTACK_POD_NAMESPACE": "n", "GRSTACK_PROGRESS_INTERVAL": "3600",
           "GRSTACK_KUBE_API": f"http://127.0.0.1:{api.server_port}"}
    subprocess.run([sys.executable, "-P", "-c", code], env=env, check=True, timeout=60)
    last = json.loads(api.requests[-1][2]["metadata"]["annotations"]["grstack.io/progress"])
    assert last["step"] == 9 and last["finished"] is True and last["metrics"] == {"ndcg@10": 0.25}

"""The commands that load a model file, run as a user runs them, on a planted ``model.pt``: one ``error:``
line naming the file, exit 2, and the payload never ran (``grstack eval`` and ``grstack serve ranker``, whose
``--checkpoint`` is also where a GRRankingService's fetched s3/gs/https model lands)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration


class Payload:
    """Unpickled, it writes ``marker`` (an attacker's ``__reduce__``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _grstack(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-P", "-m", "grstack.runtime.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture
def planted(tmp_path: Path) -> tuple[Path, Path]:
    """A run directory whose ``model.pt`` carries the payload, and the payload's marker file."""
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    run.mkdir()
    torch.save({"format": "grstack-model", "version": 3, "state_dict": {"w": Payload(marker)}}, run / "model.pt")
    return run, marker


@pytest.mark.parametrize("command", ["eval", "serve-ranker"])
def test_a_planted_model_runs_nothing_from_the_cli(planted: tuple[Path, Path], command: str) -> None:
    run, marker = planted
    args = (["eval", "--run", str(run)] if command == "eval" else
            ["serve", "ranker", "--checkpoint", str(run / "model.pt"), "--host", "127.0.0.1", "--port", "0"])
    proc = _grstack(*args)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-2000:]
    assert err.count("\n") == 0 and err.startswith("error: ") and str(run / "model.pt") in err
    assert "Python callable" in err and "Traceback" not in err
    assert not marker.exists()

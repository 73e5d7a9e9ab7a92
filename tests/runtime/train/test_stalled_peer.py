"""A peer that stops making progress but stays alive (a stall, not a death: tests/runtime/train/
test_distributed_train.py covers a dead peer). Ranks started as independent processes, as pods are, on gloo:
rank 1 stalls after step 3; rank 0's next collective fails at distributed.timeout_s and rank 0 exits with
status 3 and one ``error:`` line naming the collective, its group, the timeout and the likely cause; rank 1
itself is ended by its Watchdog (no progress for three timeouts), with one line and status 3 too."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from grstack_testing import set_args, tiny_config_args, write_cyclic

from grstack.runtime.train.launch import ENV_STALL, free_port, rank_env

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
TIMEOUT_S = 15


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_stalled_peer_ends_every_rank_with_one_error_line_and_status_3(tmp_path):
    data = write_cyclic(tmp_path / "cyclic", num_users=200)
    run = tmp_path / "run"
    argv = [sys.executable, "-P", "-m", "grstack.runtime.cli", "train", "--config", str(CONFIG), "--out", str(run),
            "--no-progress", *set_args([*tiny_config_args(data), "train.num_threads=1",
                                        f"distributed.timeout_s={TIMEOUT_S}"])]
    port = free_port()
    procs = [subprocess.Popen(argv, env={**os.environ, **rank_env(r, 2, port), ENV_STALL: "1:3"},
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "rank 1 stalls after step 3" in outs[1]
    assert procs[0].returncode == 3, outs[0]
    (line,) = _errors(outs[0])
    assert line.startswith("error: rank 0: lost contact with a peer (") and " on group " in line, line
    assert f"distributed.timeout_s={TIMEOUT_S}" in line and "died or stalled" in line and "restarted" in line
    assert procs[1].returncode == 3, outs[1]
    (line,) = _errors(outs[1])
    assert line.startswith("error: rank 1: no progress for ") and f"3 x distributed.timeout_s={TIMEOUT_S}" in line
    assert not (run / "summary.json").exists()

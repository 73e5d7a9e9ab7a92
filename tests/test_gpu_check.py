"""``bench/gpu_check.sh --dry-run`` runs every step of the accelerator check on this machine's CPU and exits 0
only when every step passed; a wheel it needs that cannot be installed stops it at once (docs/gpu-check.md)."""

from __future__ import annotations

import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STEPS = ("train_nccl", "bench_kernels", "kernel_tests", "mfu", "relay_engine")
FILES = {"summary.txt", "log.txt", "train_nccl.json", "kernels.json", "kernel_tests.txt", "kernel_tests.xml",
         "mfu.json", "relay_engine.json"}


def check(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out), **env})


def step_lines(summary: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w+): (exit \d+|not selected|skipped).*$", summary,
                                                          re.M) if m.group(1) in STEPS}


def test_dry_run_runs_every_step_on_cpu_and_passes(tmp_path):
    res = check(tmp_path, "--dry-run")
    summary = (tmp_path / "summary.txt").read_text()
    assert res.returncode == 0, summary + res.stderr[-2000:]
    assert step_lines(summary) == dict.fromkeys(STEPS, "exit 0")
    # the NCCL step comes first; the digest reads every result; at most 8 files come back from the device tool
    assert summary.index("train_nccl: exit") < min(summary.index(f"{s}: exit") for s in STEPS[1:])
    assert "train_nccl: backend gloo, 3 steps" in summary and "host syncs per step" in summary
    assert re.search(r"kernel_tests: [1-9]\d* tests, 0 failed", summary) and "relay_engine L=" in summary
    assert {p.name for p in tmp_path.iterdir()} == FILES


def test_only_runs_the_named_steps(tmp_path):
    res = check(tmp_path, "--dry-run", "--only", "mfu,relay_engine")
    summary = (tmp_path / "summary.txt").read_text()
    assert res.returncode == 0, summary + res.stderr[-2000:]
    assert step_lines(summary) == {"train_nccl": "not selected", "bench_kernels": "not selected",
                                   "kernel_tests": "not selected", "mfu": "exit 0", "relay_engine": "exit 0"}
    assert "no JSON" not in summary


def test_a_failing_step_makes_the_check_fail(tmp_path):
    # too little time for a step's minimum: skipped, and the check says it did not pass
    res = check(tmp_path, "--dry-run", "--only", "mfu", GPU_CHECK_BUDGET_S="3")
    summary = (tmp_path / "summary.txt").read_text()
    assert res.returncode == 1 and step_lines(summary) == {**dict.fromkeys(STEPS[:3], "not selected"),
                                                          "mfu": "skipped", "relay_engine": "not selected"}


def test_unknown_step_is_refused_in_one_line(tmp_path):
    res = check(tmp_path, "--dry-run", "--only", "mfu,nope")
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: unknown step 'nope' (steps: {' '.join(STEPS)})"]


def test_a_missing_wheel_without_a_wheel_folder_stops_at_once(tmp_path):
    # an interpreter without pydantic (a bare venv of this Python) and no wheel folder to install it from
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, system_site_packages=False)
    assert subprocess.run([bare / "bin" / "python", "-c", "import pydantic"], capture_output=True).returncode
    out = tmp_path / "out"
    res = check(out, "--dry-run", PY=str(bare / "bin" / "python"), GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"error: pydantic is missing and there is no {tmp_path / 'no-wheels'}/ (run bash bench/gpu_wheels.sh "
        "here and carry .whl)"]
    assert "train_nccl" not in (out / "summary.txt").read_text()  # no step ran


def test_help_prints_the_header_without_running_anything(tmp_path):
    res = check(tmp_path, "--help")
    assert res.returncode == 0 and "--dry-run" in res.stdout and "--only" in res.stdout
    assert not (tmp_path / "summary.txt").exists()

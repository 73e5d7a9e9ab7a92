"""tests/conftest.py under CI: a "SKIPPED LOUDLY" skip (a tool CI installs is missing) fails the run when CI is
set and stays a skip elsewhere; other skips are skips everywhere. Runs pytest on a scratch project that uses
this repository's conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TESTS = '''
import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def tool():
    pytest.skip("SKIPPED LOUDLY: the tool binary is missing")


def test_in_the_body():
    pytest.skip("SKIPPED LOUDLY: the tool binary is missing")


def test_in_a_fixture(tool):
    pass


def test_optional_data():
    pytest.skip("no real data on this machine")
'''


def _pytest(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_scratch.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    return subprocess.run([sys.executable, "-P", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_missing_tool_is_a_skip(tmp_path: Path, ci: str | None) -> None:
    run = _pytest(tmp_path, ci)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 skipped" in run.stdout and run.stdout.count("SKIPPED LOUDLY") == 2


@pytest.mark.parametrize("ci", ["true"])
def test_under_ci_a_missing_tool_fails_the_run(tmp_path: Path, ci: str) -> None:
    run = _pytest(tmp_path, ci)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout and "1 error" in run.stdout and "1 skipped" in run.stdout, run.stdout
    assert f"CI is set (CI={ci}), so this test must run, not skip: SKIPPED LOUDLY" in run.stdout
    assert "no real data on this machine" in run.stdout  # an optional skip stays a skip

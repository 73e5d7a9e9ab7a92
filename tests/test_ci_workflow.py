"""CI runs .ci/run on every push and pull request, and the test commands print every skip with its reason."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_the_workflow_runs_ci_run_on_pushes_and_pull_requests_with_python_311() -> None:
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "ci.yml").read_text())
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert {"push", "pull_request"} <= set(triggers)
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and str(job["env"]["CI"]) == "true"
    setup = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/setup-python"))
    assert str(setup["with"]["python-version"]) == "3.11"
    assert [s["run"].strip() for s in job["steps"] if "run" in s] == [".ci/run"]


def test_ci_run_installs_etcd_through_sudo_when_not_root_and_runs_make_test() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert (REPO / ".ci" / "run").stat().st_mode & 0o111, ".ci/run must be executable"
    assert "sudo -n" in script and 'id -u' in script and "etcd-server" in script
    assert 'export CI="${CI:-true}"' in script and script.rstrip().endswith("make test")


@pytest.mark.parametrize("target", ["test", "test-unit"])
def test_make_test_targets_list_skips(target: str) -> None:
    recipe = re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None and "pytest" in recipe.group(1) and " -rs" in recipe.group(1)

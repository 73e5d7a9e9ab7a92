"""What an install of grstack is: one version everywhere, extras that keep torch out of the operator's
install, and a CLI that names the missing extra instead of failing with a traceback.

A module that is not installed is simulated the way Python itself reports one: ``sys.modules[name] =
None`` makes ``import name`` raise ModuleNotFoundError and ``find_spec`` return None.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from grstack.runtime import __version__
from grstack.runtime.cli import EXTRA_MODULES, SUBCOMMANDS, main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
HEAVY = {"torch", "numpy", "pyarrow", "tqdm", "matplotlib", "triton"}


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def _run_without(modules: set[str], code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _m in {sorted(modules)!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run([sys.executable, "-P", "-c", prelude + code], capture_output=True, text=True,
                          timeout=120)


def test_version_flag_prints_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"grstack {__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_pyproject_reads_the_version_from_the_package() -> None:
    assert "version" not in PYPROJECT["project"]
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "grstack.runtime.__version__"}


def test_chart_and_image_tag_carry_the_package_version() -> None:
    chart = yaml.safe_load((REPO / "charts" / "grstack" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__, "bump charts/grstack/Chart.yaml appVersion with __version__"
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make binary on this machine")
    out = subprocess.run([make, "-s", "-C", str(REPO), "--eval", "print-version: ; @echo $(IMAGE_VERSION)",
                          "print-version"], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == __version__


def test_license_file_is_the_apache_license() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_core_and_operator_extra_need_no_torch() -> None:
    core = _names(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert not core & HEAVY, core
    assert not _names(extras["operator"]) & HEAVY, extras["operator"]
    assert "torch" in _names(extras["train"]) and "torch" in _names(extras["serve"])
    assert _names(extras["train"]) | _names(extras["serve"]) | _names(extras["operator"]) <= _names(extras["all"])


def test_every_extra_the_cli_names_exists() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRA_MODULES) <= set(extras)
    for _, _, _, needs in SUBCOMMANDS:
        assert set(needs) <= set(EXTRA_MODULES)
    setup = (REPO / "Makefile").read_text()
    assert '-e ".[test,all]"' in setup  # the development venv has every extra


def test_a_missing_extra_is_one_error_line() -> None:
    out = _run_without({"torch"}, "from grstack.runtime.cli import main\n"
                                  "sys.exit(main(['train', '--config', 'x.yaml', '--set', 'a=1']))")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["error: grstack train needs torch: pip install 'grstack[train]'"]
    out = _run_without({"kopf"}, "from grstack.runtime.cli import main\nsys.exit(main(['operator']))")
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["error: grstack operator needs kopf: pip install 'grstack[operator]'"]


def test_help_lists_every_subcommand_without_the_extras() -> None:
    out = _run_without(HEAVY | {"aiohttp", "kopf", "kubernetes"},
                       "from grstack.runtime.cli import main\nmain(['--help'])")
    assert out.returncode == 0, out.stderr
    for name, _, _, _ in SUBCOMMANDS:
        assert re.search(rf"^\s+{name}\s", out.stdout, flags=re.M), (name, out.stdout)
    assert "needs grstack[train]" in out.stdout


def test_operator_and_crds_run_without_the_training_stack(tmp_path: Path) -> None:
    """The operator's whole import path, its default training config check and ``grstack crds``."""
    code = ("import grstack.operator.handlers, grstack.operator.training, grstack.operator.serving\n"
            "from grstack.operator.trainconfig import default_training_config, validate\n"
            "validate(default_training_config(), [])\n"
            "from grstack.runtime.cli import main\n"
            f"assert main(['crds', '--out', {str(tmp_path)!r}]) == 0\n"
            "try:\n    main(['operator', '--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n")
    out = _run_without(HEAVY | {"psutil", "aetcd"}, code)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("*.grstack.io.yaml")) == [
        "grrankingservices.grstack.io.yaml", "grtrainingjobs.grstack.io.yaml"]

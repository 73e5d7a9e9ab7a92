"""The product as users (and the images) install it: the wheel, built from what the Dockerfile's wheel stage
copies, installed non-editably into a fresh venv outside the repository, run from a directory outside it.

The development venv's editable install hides packaging faults (its path hook imports what the package
forgets to, it maps configs/ from the checkout), so nothing here may reach the checkout: the new venv sees
the development venv's third-party packages through a plain ``.pth`` path entry (no network needed), which
does not run the ``.pth`` hooks inside that directory, so the editable ``grstack`` stays out of reach; the
test checks both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest

from grstack.runtime import __version__
from grstack.runtime.cli import SUBCOMMANDS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]  # the wheel build and a demo on 2 cores

REPO = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "numpy", "pyarrow", "tqdm", "matplotlib", "triton"}

# Run inside the new venv: every (nested) subcommand of the installed parser, each with --help.
WALK_HELP = """
import argparse, contextlib, io, json, sys
from grstack.runtime.cli import build_parser, main

def walk(parser, path):
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, [*path, name])

results = {}
for path in list(walk(build_parser(), []))[1:]:
    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf):
        try:
            main([*path, "--help"])
        except SystemExit as exc:
            code = exc.code or 0
    results[" ".join(path)] = [code, buf.getvalue().startswith("usage: grstack " + " ".join(path))]
print(json.dumps(results))
"""


def _wheel_sources() -> list[str]:
    dockerfile = (REPO / "Dockerfile").read_text()
    body = dockerfile.split("AS wheel\n", 1)[1].split("\nFROM ", 1)[0]
    return [src for line in re.findall(r"^COPY (?!--from)(.+)$", body, flags=re.M) for src in line.split()[:-1]]


def _requires(wheel: Path) -> list[tuple[str, str]]:
    """(distribution, marker) of every Requires-Dist line of the wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    out = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req, _, marker = line.split(":", 1)[1].partition(";")
            out.append((re.match(r"\s*([A-Za-z0-9_.-]+)", req).group(1).lower(), marker.strip()))
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("wheel-install")
    assert REPO not in root.parents
    src = root / "src"
    src.mkdir()
    for name in _wheel_sources():
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-P", "-m", "pip"]
    subprocess.run([*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist")],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "dist").glob("grstack-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-P", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "grstack-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = root / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GRSTACK_CONFIG_DIR", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}", HOME=str(root),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    # Before the wheel: the development venv's packages are visible, its editable grstack is not.
    probe = subprocess.run([str(python), "-c", "import torch, kopf; import grstack.runtime"], cwd=work, env=env,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'grstack" in probe.stderr, probe.stderr
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return {"root": root, "wheel": wheel, "venv": venv, "python": python, "work": work,
            "grstack": venv / "bin" / "grstack", "env": env}


def _run(installed: dict[str, Any], *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(installed["grstack"]), *argv], cwd=installed["work"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)


def test_the_installed_package_is_the_wheel(installed: dict[str, Any]) -> None:
    code = ("import grstack.runtime, grstack.operator, grstack.kernels\n"
            "from grstack.runtime.config_files import config_dir\n"
            "from grstack.runtime.bench.serve_simulate import VALIDATION_DIR\n"
            "print(grstack.runtime.__file__); print(config_dir()); print(VALIDATION_DIR)")
    out = subprocess.run([str(installed["python"]), "-c", code], cwd=installed["work"], env=installed["env"],
                         capture_output=True, text=True, check=True)
    module, configs, validation = (Path(line) for line in out.stdout.split())
    assert installed["venv"] in module.parents
    assert installed["venv"] in configs.parents and (configs / "synthetic-tiny-hstu.yaml").is_file()
    assert {p.name for p in configs.glob("*.yaml")} == {p.name for p in (REPO / "configs").glob("*.yaml")}
    # the serving simulator's stored real runs (its validation, the paper profile's host costs)
    assert installed["venv"] in validation.parents
    shipped = {str(p.relative_to(validation)) for p in validation.rglob("*.json*")}
    assert shipped == {str(p.relative_to(REPO / "runtime/bench/serve_validation"))
                       for p in (REPO / "runtime/bench/serve_validation").rglob("*.json*")}
    assert any(p.name == "held-out-steps.json.gz" for p in validation.iterdir())  # the host's speed, measured


def test_the_operator_install_needs_no_torch(installed: dict[str, Any]) -> None:
    needed = {name for name, marker in _requires(installed["wheel"])
              if not marker or re.fullmatch(r'extra\s*==\s*"operator"', marker)}
    assert {"kopf", "kubernetes", "pydantic"} <= needed
    assert not needed & HEAVY, needed
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in zipfile.ZipFile(installed["wheel"]).namelist())


def test_version_and_help(installed: dict[str, Any]) -> None:
    out = _run(installed, "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"grstack {__version__}", out.stderr
    out = _run(installed, "--help")
    assert out.returncode == 0, out.stderr
    for name, _, _, _ in SUBCOMMANDS:
        assert re.search(rf"^\s+{name}\s", out.stdout, flags=re.M), name
        sub = _run(installed, name, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: grstack {name}"), (name, sub.stderr)


def test_every_nested_subcommand_has_help(installed: dict[str, Any]) -> None:
    out = subprocess.run([str(installed["python"]), "-c", WALK_HELP], cwd=installed["work"], env=installed["env"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.splitlines()[-1])
    assert {path for path in results if " " not in path} == {name for name, _, _, _ in SUBCOMMANDS}
    assert len(results) > len(SUBCOMMANDS)  # data, bench and serve have subcommands of their own
    assert {path: r for path, r in results.items() if r != [0, True]} == {}


def test_demo_quick_runs_from_the_wheel(installed: dict[str, Any]) -> None:
    run_dir = installed["root"] / "run"
    out = _run(installed, "demo", "--quick", "--out", str(run_dir), timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "popularity baseline" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] > 0 and summary["dataset"].startswith("synthetic")
    assert (run_dir / "serve_report.json").is_file()
    assert not (installed["work"] / "runs").exists()  # nothing written where it was not asked to

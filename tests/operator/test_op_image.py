"""The Dockerfile's build steps, run here without a container engine: its targets, the files it copies, the
wheel it installs (built with the same command), the config directory the image points the operator at,
and that the operator starts without importing torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from opsim import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()


@pytest.mark.unit
def test_targets_and_copied_paths() -> None:
    stages = re.findall(r"^FROM \S+ AS (\w+)", DOCKERFILE, flags=re.M)
    assert {"cpu", "cuda", "ascend"} <= set(stages)
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, flags=re.M):
        for source in line.split()[:-1]:
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which is missing"
    for stage in ("cpu", "cuda", "ascend"):
        body = DOCKERFILE.split(f"AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "USER 1000:1000" in body and "GRSTACK_CONFIG_DIR=/opt/grstack/configs" in body, stage


@pytest.mark.integration
def test_wheel_installs_every_package_and_the_entry_point(tmp_path: Path) -> None:
    """``pip wheel --no-deps`` on exactly what the wheel stage copies."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("operator", "runtime", "kernels"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("grstack-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for module in ("grstack/operator/handlers.py", "grstack/operator/cli.py", "grstack/runtime/cli.py",
                   "grstack/runtime/train/progress.py", "grstack/kernels/__init__.py"):
        assert module in files
    entry = next(n for n in files if n.endswith("entry_points.txt"))
    assert "grstack = grstack.runtime.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.unit
def test_default_config_found_through_the_image_variable(tmp_path: Path) -> None:
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    code = ("from grstack.operator.trainconfig import default_training_config; "
            "print(default_training_config().splitlines()[0])")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "GRSTACK_CONFIG_DIR": str(tmp_path / "configs")})
    assert out.stdout.strip() == (REPO / "configs" / "synthetic-tiny-hstu.yaml").read_text().splitlines()[0]


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["operator", "--help"], ["crds", "--help"]])
def test_operator_starts_without_torch(argv: list[str]) -> None:
    code = ("import sys; from grstack.runtime.cli import main\n"
            "import grstack.operator.handlers, grstack.operator.training, grstack.operator.serving\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"

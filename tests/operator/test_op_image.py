"""The Dockerfile's build steps, run here without a container engine: its targets, the files it copies, the
wheel it installs (built with the same command, the configs inside it), the config directory variable, and
that the operator starts without importing torch."""

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
    wheel_stage = DOCKERFILE.split("AS wheel\n", 1)[1].split("\nFROM ", 1)[0]
    assert {"configs", "LICENSE"} <= set(_wheel_sources())
    for stage in ("cpu", "cuda", "ascend", "operator"):
        body = DOCKERFILE.split(f"AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "USER 1000:1000" in body, stage
        # the configs are package data in the wheel: no stage copies them beside it
        assert not re.search(r"^COPY (?!--from)", body, flags=re.M), stage
    assert "pip wheel" in wheel_stage


def _wheel_sources() -> list[str]:
    """The paths the Dockerfile's wheel stage copies into its build context."""
    body = DOCKERFILE.split("AS wheel\n", 1)[1].split("\nFROM ", 1)[0]
    return [src for line in re.findall(r"^COPY (?!--from)(.+)$", body, flags=re.M) for src in line.split()[:-1]]


@pytest.mark.integration
def test_wheel_installs_every_package_and_the_entry_point(tmp_path: Path) -> None:
    """``pip wheel --no-deps`` on exactly what the wheel stage copies."""
    src = tmp_path / "src"
    src.mkdir()
    for name in _wheel_sources():
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("grstack-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    for module in ("grstack/operator/handlers.py", "grstack/operator/cli.py", "grstack/runtime/cli.py",
                   "grstack/runtime/train/progress.py", "grstack/kernels/__init__.py",
                   "grstack/configs/synthetic-tiny-hstu.yaml"):
        assert module in files
    assert {f"grstack/configs/{p.name}" for p in (REPO / "configs").glob("*.yaml")} <= files
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in files)
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


# ------------------------------------------------------------------------------ make image, release workflow

CHART_VALUES = REPO / "charts" / "grstack" / "values.yaml"


def _chart_image() -> tuple[str, str]:
    import yaml

    repository = yaml.safe_load(CHART_VALUES.read_text())["image"]["repository"]
    version = yaml.safe_load((REPO / "charts" / "grstack" / "Chart.yaml").read_text())["appVersion"]
    return repository, version


@pytest.mark.unit
def test_operator_image_has_no_torch() -> None:
    body = DOCKERFILE.split("AS operator\n", 1)[1].split("\nFROM ", 1)[0]
    assert "torch" not in body.replace("no torch", "").replace("include torch", "")
    # the core dependencies and the operator extra, which name no torch (tests/runtime/test_packaging.py)
    assert '.whl)[operator]"' in body and "--no-deps" not in body and "USER 1000:1000" in body


def _make_image(tmp_path: Path, path: str, **variables: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    if make is None:
        pytest.skip("no make binary on this machine")
    args = [make, "-s", "-C", str(REPO), "image", *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(args, capture_output=True, text=True, env={"PATH": path, "HOME": str(tmp_path)},
                          timeout=60)


@pytest.mark.unit
def test_make_image_without_a_builder_says_so(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "sed", "head", "basename"):  # what the recipe needs, and no docker/podman/buildah
        (bare / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    out = _make_image(tmp_path, str(bare))
    assert out.returncode != 0
    assert "none of docker, podman or buildah is on PATH" in out.stderr
    out = _make_image(tmp_path, str(bare), IMAGE_BUILDER="podman")
    assert out.returncode != 0 and "(podman not found)" in out.stderr


@pytest.mark.unit
@pytest.mark.parametrize(("builder", "verb"), [("docker", "build"), ("podman", "build"), ("buildah", "bud")])
def test_make_image_builds_every_target_with_the_builder_found(tmp_path: Path, builder: str, verb: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    fake = bin_dir / builder
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    for tool in ("sh", "sed", "head", "basename"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    out = _make_image(tmp_path, str(bin_dir), PUSH="1")
    assert out.returncode == 0, out.stderr
    repository, version = _chart_image()
    calls = log.read_text().splitlines()
    for target in ("cpu", "cuda", "ascend", "operator"):
        assert f"{verb} --target {target} -t {repository}:{version}-{target} ." in calls
        assert f"push {repository}:{version}-{target}" in calls


@pytest.mark.unit
def test_release_workflow_builds_and_pushes_every_target_on_a_tag() -> None:
    import yaml

    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())
    triggers = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads `on` as true
    assert triggers["push"]["tags"] == ["v*"]
    job = workflow["jobs"]["images"]
    assert job["strategy"]["matrix"]["target"] == ["cpu", "cuda", "ascend", "operator"]
    build = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["push"] is True and build["with"]["target"] == "${{ matrix.target }}"
    script = next(s["run"] for s in job["steps"] if s.get("id") == "image")
    assert "charts/grstack/values.yaml" in script and "Chart.yaml" in script  # the one place


@pytest.mark.unit
def test_examples_and_chart_name_the_same_image() -> None:
    """The chart's values.yaml (repository) and Chart.yaml (appVersion) are the one place: the examples use
    REPOSITORY:VERSION-TARGET."""
    import yaml

    repository, version = _chart_image()
    images = {}
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            image = ((doc or {}).get("spec") or {}).get("image")
            if image:
                images[example.name] = image
    assert images, "no example names an image"
    for name, image in images.items():
        assert re.fullmatch(rf"{re.escape(repository)}:{re.escape(version)}-(cpu|cuda|ascend)", image), (name, image)

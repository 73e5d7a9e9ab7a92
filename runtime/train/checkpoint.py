"""Checkpoints written atomically (temp file + rename) and found again for exact resume."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from grstack.runtime.errors import UserError

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{9})\.pt$")


def atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step-{step:09d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    path = checkpoint_path(run_dir, step)
    atomic_torch_save(state, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from None

"""Checkpoints written atomically (temp file + rename) and found again for exact resume."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from grstack.runtime.model import atomic_torch_save

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{9})\.pt$")


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


"""Run-directory rules of the trainer."""

from __future__ import annotations

import shutil
from pathlib import Path

# What a run writes before its first checkpoint (plus the checkpoint folders themselves, still empty).
PREPARED = {"config.yaml", "dataset", "metrics.jsonl", "model.pt", "model.items", "training_curve.png", "checkpoints"}


def reclaim_unstarted(run_dir: Path, config_text: str) -> bool:
    """Clears a directory left by an earlier attempt of the *same* config that died before its first checkpoint.

    A restarted gang (e.g. a worker killed during the first epoch) must start over instead of failing on a
    non-empty directory; anything else in the directory (another config, foreign files, checkpoints) is
    left alone and the caller reports it.
    """
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file() or cfg_file.read_text() != config_text:
        return False
    entries = [p for p in run_dir.iterdir() if not p.name.startswith(".")]
    if any(p.name not in PREPARED for p in entries):
        return False
    folder = run_dir / "checkpoints"
    if folder.is_dir() and any(not p.name.startswith(".") for p in folder.iterdir()):
        return False
    for p in run_dir.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return True

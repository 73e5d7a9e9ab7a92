"""Locating the ready configs shipped in ``configs/`` (repo checkout, editable install or image)."""

from __future__ import annotations

import os
from pathlib import Path

from grstack.runtime.errors import UserError

ENV_VAR = "GRSTACK_CONFIG_DIR"


def config_dir() -> Path:
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "configs"


def config_path(name: str) -> Path:
    """``name`` with or without ``.yaml``; a path that exists is returned as is."""
    direct = Path(name)
    if direct.is_file():
        return direct
    p = config_dir() / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not p.is_file():
        raise UserError(f"no config named {name!r} in {config_dir()} (set {ENV_VAR} to point elsewhere)")
    return p

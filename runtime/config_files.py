"""Locating the ready configs shipped in ``configs/``.

One rule covers every install: the configs sit next to the ``grstack.runtime`` package. In a checkout (and
its editable install) that is the repository's ``configs/``; the wheel ships them as package data in
``grstack/configs`` (setup.py maps ``configs/`` there), which is what the images install.
"""

from __future__ import annotations

import os
from pathlib import Path

from grstack.runtime.errors import UserError

ENV_VAR = "GRSTACK_CONFIG_DIR"


def config_dir() -> Path:
    """``$GRSTACK_CONFIG_DIR`` when set, else the shipped configs (see the module docstring)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "configs"


def config_path(name: str) -> Path:
    """``name`` with or without ``.yaml``; a path that exists is returned as is."""
    direct = Path(name)
    if direct.is_file():
        return direct
    if direct.is_dir():
        raise UserError(f"config {name} is a directory, expected a YAML file or the name of one in {config_dir()}")
    p = config_dir() / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not p.is_file():
        raise UserError(f"no config named {name!r} in {config_dir()} (set {ENV_VAR} to point elsewhere)")
    return p

"""The trainer config a GRTrainingJob runs: the CR's inline YAML, or the built-in synthetic demo, plus ``--set``
overrides derived from the spec; validated here with the trainer's own pydantic model so a bad config is an
``InvalidSpec`` condition on the job instead of N crashing pods.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

from grstack.operator.models import GRTrainingJobSpec

DEFAULT_CONFIG = "synthetic-tiny-hstu.yaml"


@functools.cache
def default_training_config() -> str:
    """The YAML text of the built-in demo config (``configs/synthetic-tiny-hstu.yaml``).

    Found through ``grstack.runtime.config_files`` (``$GRSTACK_CONFIG_DIR`` in images, the repository's
    ``configs/`` in a checkout), else next to the installed package.
    """
    candidates: list[Path] = []
    try:
        from grstack.runtime.config_files import config_dir

        candidates.append(config_dir() / DEFAULT_CONFIG)
    except ImportError:
        pass
    here = Path(__file__).resolve()
    candidates += [here.parents[1] / "configs" / DEFAULT_CONFIG, here.parent / "configs" / DEFAULT_CONFIG]
    for path in candidates:
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"{DEFAULT_CONFIG} not found in {', '.join(str(p.parent) for p in candidates)}; "
                            "set GRSTACK_CONFIG_DIR")


def config_text(spec: GRTrainingJobSpec) -> str:
    return spec.config if spec.config is not None else default_training_config()


def overrides(spec: GRTrainingJobSpec) -> list[str]:
    """``key=value`` items for ``grstack train --set``: typed spec fields first, then ``spec.overrides``."""
    items: dict[str, Any] = {}
    if spec.max_steps is not None:
        items["train.max_steps"] = spec.max_steps
    if spec.checkpoint.interval_steps is not None:
        items["train.checkpoint_every"] = spec.checkpoint.interval_steps
    if spec.data.format is not None:
        items["data.format"] = spec.data.format
    if spec.data.source is not None:
        items["data.source"] = spec.data.source
    items.update(spec.overrides)
    return [f"{key}={_scalar(value)}" for key, value in items.items()]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def validate(text: str, items: list[str]) -> None:
    """Raises ValueError naming the field when the trainer would reject this config with these overrides."""
    from grstack.runtime.errors import UserError
    from grstack.runtime.training_config import load_config

    with tempfile.TemporaryDirectory(prefix="grstack-config-") as tmp:
        path = os.path.join(tmp, "config.yaml")
        Path(path).write_text(text)
        try:
            load_config(path, items)
        except UserError as exc:
            raise ValueError(str(exc).replace(path, "spec.config")) from None

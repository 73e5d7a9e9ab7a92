"""The exported model (``RUN/model.pt``) and the atomic file helpers every checkpoint uses.

The artefact's format belongs to the model, not to whoever writes it: training exports it, evaluation and
serving load it, and none of them needs the others. An artefact is the weights plus what rebuilds the
model (the config, the item count, the task names of the ranking head).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grstack.runtime.data import SequenceDataset
from grstack.runtime.errors import UserError
from grstack.runtime.model.build import build_model
from grstack.runtime.training_config import Config

FORMAT = "grstack-model"
FORMAT_VERSION = 1
BEST_MODEL = "model.pt"  # the run directory's exported best model
DATASET_DIR = "dataset"  # the run directory's copy of the training data (Parquet)


def task_names(ds: SequenceDataset) -> list[str]:
    """Ranking-head tasks: the next-item target, then one per action bit of the dataset."""
    return ["next", *ds.action_names] if ds.actions is not None else ["next"]


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file and rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A torch file as a dict; a missing, truncated or foreign file is a UserError naming it."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})") from None


def export_model(model: nn.Module, cfg: Config, ds: SequenceDataset, path: Path) -> None:
    """Writes the serving artefact: weights plus what is needed to rebuild the model."""
    atomic_torch_save({"format": FORMAT, "version": FORMAT_VERSION, "config": cfg.model_dump(mode="json"),
                       "num_items": ds.num_items, "tasks": task_names(ds), "state_dict": model.state_dict()},
                      path)


def load_exported(path: Path) -> tuple[nn.Module, Config, list[str]]:
    """The exported model in eval mode, its config and its task names."""
    blob = load_checkpoint(path)
    if blob.get("format") != FORMAT:
        raise UserError(f"{path} is not an exported grstack model")
    cfg = Config.model_validate(blob["config"])
    tasks = blob["tasks"]
    model = build_model(cfg.model, blob["num_items"], cfg.data.max_len, num_tasks=len(tasks))
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, cfg, tasks


def resolve_model_file(path: str | Path) -> Path:
    """A model file, or a run directory holding ``model.pt``."""
    p = Path(path)
    if p.is_dir():
        p = p / BEST_MODEL
    if not p.is_file():
        raise UserError(f"checkpoint {path} not found (expected an exported {BEST_MODEL} or a run directory "
                        f"containing one; `grstack train` writes it)")
    return p

"""Loads the dataset a config names: a Parquet dataset, an import from raw files, or a synthetic preset."""

from __future__ import annotations

from pathlib import Path

from grstack.runtime.data.dataset import SequenceDataset, read_dataset
from grstack.runtime.errors import UserError
from grstack.runtime.training_config import DataConfig


def load_source(cfg: DataConfig) -> SequenceDataset:
    """Everything is read into memory before any output is written, so a bad source leaves nothing."""
    if cfg.format == "synth":
        from grstack.runtime.data.synth import synthesize

        return synthesize(cfg.source, seed=cfg.seed)
    src = Path(cfg.source)
    if not src.exists():
        raise UserError(f"data.source {src} does not exist")
    if cfg.format == "parquet":
        return read_dataset(src)
    from grstack.runtime.data.importers import import_dataset

    return import_dataset(cfg.format, src)

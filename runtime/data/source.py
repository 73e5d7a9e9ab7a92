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


def known_item_count(cfg: DataConfig) -> int | None:
    """The source's item count when it is cheap to know without loading it (a grstack dataset's metadata, a
    synthetic preset): what a launcher checks the sharding plan against before starting any rank. None when
    only an import would tell (then rank 0 checks it after loading, before anything is written)."""
    if cfg.format == "synth":
        from grstack.runtime.data.synth import PRESETS

        preset = PRESETS.get(cfg.source)
        return preset.num_items if preset is not None else None
    if cfg.format == "parquet":
        from grstack.runtime.data.dataset import read_meta

        return int(read_meta(cfg.source)["num_items"])
    return None

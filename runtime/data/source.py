"""Loads the dataset a config names: a Parquet dataset (``fetched:NAME``: one in the fetch cache), an import
from raw files, or a synthetic preset."""

from __future__ import annotations

from grstack.runtime.data.dataset import SequenceDataset, read_dataset
from grstack.runtime.data.fetch.cache import check_format, source_path
from grstack.runtime.errors import UserError
from grstack.runtime.training_config import DataConfig


def load_source(cfg: DataConfig) -> SequenceDataset:
    """Everything is read into memory before any output is written, so a bad source leaves nothing. The
    dataset keeps only the side-feature fields the config names (:func:`select_features`)."""
    if cfg.timestamp_unit != "auto" and cfg.format in ("synth", "parquet"):
        raise UserError(f"data.timestamp_unit {cfg.timestamp_unit} applies to imports; format {cfg.format} "
                        "holds Unix seconds already")
    if cfg.format == "synth":
        from grstack.runtime.data.synth import synthesize

        return select_features(synthesize(cfg.source, seed=cfg.seed), cfg)
    check_format(cfg.source, cfg.format)
    src = source_path(cfg.source)  # fetched:NAME -> its dataset in the cache, or how to fetch it
    if not src.exists():
        raise UserError(f"data.source {src} does not exist")
    if cfg.format == "parquet":
        return select_features(read_dataset(src), cfg)
    from grstack.runtime.data.importers import import_dataset

    opts: dict = {}
    if cfg.item_features:
        opts |= {"item_features": cfg.item_features_file, "item_fields": list(cfg.item_features)}
    if cfg.user_features:
        opts |= {"user_features": cfg.user_features_file, "user_fields": list(cfg.user_features)}
    if cfg.rating_actions:
        opts["ratings"] = True
    if cfg.timestamp_unit != "auto":
        opts["timestamp_unit"] = cfg.timestamp_unit
    return select_features(import_dataset(cfg.format, src, **opts), cfg)


def select_features(ds: SequenceDataset, cfg: DataConfig) -> SequenceDataset:
    """``ds`` with only the side-feature fields ``cfg`` names, in its order (none: no features); a field
    the dataset lacks is a UserError naming ``data.item_features`` or ``data.user_features``."""
    for kind, names in (("item", cfg.item_features), ("user", cfg.user_features)):
        attr = f"{kind}_features"
        feats = getattr(ds, attr)
        if not names:
            setattr(ds, attr, None)
        elif feats is None:
            raise UserError(f"data.{attr}: the dataset {ds.name} has no {kind} features (import them with "
                            f"`grstack data import --{kind}-features`, or use a format with a side file)")
        else:
            setattr(ds, attr, feats.select(list(names), f"data.{attr}"))
    return ds


def known_item_count(cfg: DataConfig) -> int | None:
    """The source's item count when it is cheap to know without loading it (a grstack dataset's metadata, a
    synthetic preset): what a launcher checks the sharding plan against before starting any rank. None when
    only an import would tell (then rank 0 checks it after loading, before anything is written)."""
    if cfg.format == "synth":
        from grstack.runtime.data.synth import PRESETS

        preset = PRESETS.get(cfg.source)
        return preset.num_items if preset is not None else None
    check_format(cfg.source, cfg.format)
    if cfg.format == "parquet":
        from grstack.runtime.data.dataset import read_meta

        return int(read_meta(source_path(cfg.source))["num_items"])
    return None

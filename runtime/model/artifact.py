"""The exported model (``RUN/model.pt``) and the atomic file helpers every checkpoint uses.

The artefact's format belongs to the model, not to whoever writes it: training exports it, evaluation and
serving load it, and none of them needs the others. An artefact is the weights plus what rebuilds the
model (the config, the item count, the task names of the ranking head, and the item side-feature map when the
model embeds side features: model/side_features.py).

Two forms, both read by :func:`load_exported`: one file holding every weight (version 1), or one file
holding the dense weights and naming the item table's row parts (version 2), written by a sharded run
without any rank holding the whole table: ``model.items/<tag>/part-<k>-of-<G>.pt`` next to ``model.pt``
holds rows ``k, k + G, ...`` (shard ``k`` of ``G``). Parts are written first, then ``model.pt``
(atomically), then older part folders are removed, so ``model.pt`` always names parts that exist.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grstack.runtime.data import SequenceDataset
from grstack.runtime.errors import UserError
from grstack.runtime.model.build import build_model
from grstack.runtime.model.side_features import ItemFeatureMap
from grstack.runtime.training_config import Config

FORMAT = "grstack-model"
FORMAT_VERSION = 1  # one file
PARTS_VERSION = 2  # dense weights in the file, item rows in parts
PART_FORMAT = "grstack-model-item-rows"
ITEM_KEY = "item_emb.weight"
BEST_MODEL = "model.pt"  # the run directory's exported best model
DATASET_DIR = "dataset"  # the run directory's copy of the training data (Parquet)


def item_feature_map(ds: SequenceDataset) -> ItemFeatureMap | None:
    """The model's item feature map for a dataset whose ``item_features`` are the fields the config uses
    (``data.source.select_features``); None without side features."""
    if ds.item_features is None or not ds.item_features.fields:
        return None
    return ItemFeatureMap.from_features(ds.item_features, ds.num_items)


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
    export_state(model.state_dict(), cfg, ds, path)


def export_state(state_dict: dict[str, torch.Tensor], cfg: Config, ds: SequenceDataset, path: Path,
                 item_parts: dict[str, Any] | None = None) -> None:
    """The artefact from a state dict: every weight (one file), or the dense ones with ``item_parts``
    naming the item table's parts (:func:`export_parts`)."""
    blob = {"format": FORMAT, "version": FORMAT_VERSION if item_parts is None else PARTS_VERSION,
            "config": cfg.model_dump(mode="json"), "num_items": ds.num_items, "tasks": task_names(ds),
            "state_dict": state_dict}
    fmap = item_feature_map(ds)
    if fmap is not None:
        blob["item_features"] = fmap.to_blob()
    if ds.user_features is not None and ds.user_features.fields:
        # sizes rebuild the model; the vocabularies map the user features of serving requests
        blob["user_features"] = {"sizes": ds.user_features.sizes,
                                 "vocab": {f.name: [str(t) for t in f.vocab] for f in ds.user_features.fields}}
    if item_parts is not None:
        blob["item_parts"] = item_parts
    atomic_torch_save(blob, path)


def item_parts_dir(path: Path) -> Path:
    """The folder of ``path``'s item-row parts (``RUN/model.pt``: ``RUN/model.items``)."""
    return path.with_name(f"{path.stem}.items")


def item_part_file(path: Path, tag: str, shard: int, group_size: int) -> Path:
    return item_parts_dir(path) / tag / f"part-{shard:05d}-of-{group_size:05d}.pt"


def write_item_part(path: Path, tag: str, shard: int, group_size: int, rows: torch.Tensor) -> None:
    """Shard ``shard`` of ``group_size`` of the item table (its rows ``shard, shard + G, ...``) for the
    artefact ``path`` that :func:`export_parts` will write under ``tag``."""
    atomic_torch_save({"format": PART_FORMAT, "shard": shard, "group_size": group_size,
                       "rows": rows.detach().cpu()}, item_part_file(path, tag, shard, group_size))


def export_parts(dense_state: dict[str, torch.Tensor], cfg: Config, ds: SequenceDataset, path: Path, tag: str,
                 group_size: int, num_rows: int) -> None:
    """Writes ``path`` naming the parts already written under ``tag`` (every shard of ``group_size``), then
    removes the folders of older parts."""
    files = [item_part_file(path, tag, k, group_size).relative_to(path.parent).as_posix()
             for k in range(group_size)]
    export_state(dense_state, cfg, ds, path,
                 item_parts={"group_size": group_size, "num_rows": num_rows, "files": files})
    for old in item_parts_dir(path).iterdir():
        if old.name != tag and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)


def exported_state(path: Path, blob: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Every weight of the artefact ``path`` (its parts reassembled: this holds the whole item table)."""
    blob = load_checkpoint(path) if blob is None else blob
    state = dict(blob["state_dict"])
    parts = blob.get("item_parts")
    if parts is None:
        return state
    G, files = int(parts["group_size"]), parts["files"]
    table: torch.Tensor | None = None
    for k, name in enumerate(files):
        f = path.parent / name
        if not f.is_file():
            raise UserError(f"{path} names the item-row part {f}, which does not exist (copy the model's "
                            f"{item_parts_dir(path).name}/ folder with it)")
        part = load_checkpoint(f)
        if part.get("format") != PART_FORMAT or (part.get("shard"), part.get("group_size")) != (k, G):
            raise UserError(f"{f} is not part {k} of {G} of {path}'s item table")
        rows = part["rows"]
        if table is None:
            table = rows.new_empty((int(parts["num_rows"]), rows.shape[1]))
        table[k::G] = rows
    assert table is not None
    state[ITEM_KEY] = table
    return state


def load_exported(path: Path) -> tuple[nn.Module, Config, list[str]]:
    """The exported model in eval mode, its config and its task names (either form)."""
    model, cfg, tasks, _ = load_exported_with_vocab(path)
    return model, cfg, tasks


def load_exported_with_vocab(path: Path) -> tuple[nn.Module, Config, list[str], dict[str, list[str]] | None]:
    """:func:`load_exported` plus the user features' vocabularies (field -> raw tokens of value ids 1, 2, ...;
    None when the model reads no user context): what a server maps request user features with."""
    blob = load_checkpoint(path)
    if blob.get("format") != FORMAT:
        raise UserError(f"{path} is not an exported grstack model")
    cfg = Config.model_validate(blob["config"])
    tasks = blob["tasks"]
    fmap = ItemFeatureMap.from_blob(blob["item_features"]) if blob.get("item_features") else None
    users = dict(blob["user_features"]["sizes"]) if blob.get("user_features") else None
    model = build_model(cfg.model, blob["num_items"], cfg.data.max_len, num_tasks=len(tasks), item_features=fmap,
                        user_features=users)
    model.load_state_dict(exported_state(path, blob))
    model.eval()
    vocab = {k: list(v) for k, v in blob["user_features"]["vocab"].items()} if blob.get("user_features") else None
    return model, cfg, tasks, vocab


def resolve_model_file(path: str | Path) -> Path:
    """A model file, or a run directory holding ``model.pt``."""
    p = Path(path)
    if p.is_dir():
        p = p / BEST_MODEL
    if not p.is_file():
        raise UserError(f"checkpoint {path} not found (expected an exported {BEST_MODEL} or a run directory "
                        f"containing one; `grstack train` writes it)")
    return p

"""The exported model (``RUN/model.pt``) and the atomic file helpers every checkpoint uses.

The artefact's format belongs to the model, not to whoever writes it: training exports it, evaluation and
serving load it, and none of them needs the others. An artefact is the weights plus what rebuilds the
model (the config, the item count, the task names of the ranking head, and the item side-feature map when the
model embeds side features: model/side_features.py).

Two forms, both read by :func:`load_exported`: one file holding every weight, or one file holding the
dense weights and naming the item table's row parts, written by a sharded run without any rank holding the
whole table: ``model.items/<tag>/part-<k>-of-<G>.pt`` next to ``model.pt`` holds rows ``k, k + G, ...``
(shard ``k`` of ``G``). Parts are written first, then ``model.pt`` (atomically), then older part folders are
removed, so ``model.pt`` always names parts that exist.

Every file is read with the restricted unpickler (model/torch_files.py): a model file cannot run code.
Version 3 carries integrity digests: ``model.pt`` the sha256 of its own content, and the file sha256 of each
part it names, so a corrupted or substituted file is refused by name. Versions 1 (one file) and 2 (parts)
have no digests and still load, through the same restricted unpickler.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grstack.runtime.data import SequenceDataset
from grstack.runtime.errors import UserError
from grstack.runtime.model.build import build_model
from grstack.runtime.model.side_features import ItemFeatureMap
from grstack.runtime.model.torch_files import (
    atomic_torch_save,
    content_sha256,
    file_sha256,
    plain,
    safe_torch_load,
)
from grstack.runtime.training_config import Config

FORMAT = "grstack-model"
VERSION = 3  # either form, with digests
LEGACY_VERSIONS = (1, 2)  # one file / parts, before digests
DIGEST_KEY = "sha256"
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


def load_checkpoint(path: Path, what: str = "checkpoint", sha256: str | None = None,
                    listed_by: Path | None = None) -> dict[str, Any]:
    """A torch file that holds a dict, read without running code; a missing, truncated, foreign or
    (with ``sha256``) altered file is a UserError naming it."""
    blob = safe_torch_load(path, what, sha256, listed_by)
    if not isinstance(blob, dict):
        raise UserError(f"{what} {path} holds a {type(blob).__name__}, not the dict grstack writes")
    return blob


def export_model(model: nn.Module, cfg: Config, ds: SequenceDataset, path: Path) -> None:
    """Writes the serving artefact: weights plus what is needed to rebuild the model."""
    export_state(model.state_dict(), cfg, ds, path)


def export_state(state_dict: dict[str, torch.Tensor], cfg: Config, ds: SequenceDataset, path: Path,
                 item_parts: dict[str, Any] | None = None) -> None:
    """The artefact from a state dict: every weight (one file), or the dense ones with ``item_parts``
    naming the item table's parts (:func:`export_parts`)."""
    blob: dict[str, Any] = {"format": FORMAT, "version": VERSION, "config": cfg.model_dump(mode="json"),
                            "num_items": ds.num_items, "tasks": task_names(ds), "state_dict": state_dict}
    fmap = item_feature_map(ds)
    if fmap is not None:
        blob["item_features"] = fmap.to_blob()
    if ds.user_features is not None and ds.user_features.fields:
        # sizes rebuild the model; the vocabularies map the user features of serving requests
        blob["user_features"] = {"sizes": ds.user_features.sizes,
                                 "vocab": {f.name: [str(t) for t in f.vocab] for f in ds.user_features.fields}}
    if item_parts is not None:
        blob["item_parts"] = item_parts
    blob = plain(blob)
    blob[DIGEST_KEY] = content_sha256(blob)
    atomic_torch_save(blob, path)


def item_parts_dir(path: Path) -> Path:
    """The folder of ``path``'s item-row parts (``RUN/model.pt``: ``RUN/model.items``)."""
    return path.with_name(f"{path.stem}.items")


def item_part_file(path: Path, tag: str, shard: int, group_size: int) -> Path:
    return item_parts_dir(path) / tag / f"part-{shard:05d}-of-{group_size:05d}.pt"


def write_item_part(path: Path, tag: str, shard: int, group_size: int, rows: torch.Tensor) -> str:
    """Shard ``shard`` of ``group_size`` of the item table (its rows ``shard, shard + G, ...``) for the
    artefact ``path`` that :func:`export_parts` will write under ``tag``; returns the file's sha256."""
    return atomic_torch_save({"format": PART_FORMAT, "shard": shard, "group_size": group_size,
                              "rows": rows.detach().cpu()}, item_part_file(path, tag, shard, group_size))


def export_parts(dense_state: dict[str, torch.Tensor], cfg: Config, ds: SequenceDataset, path: Path, tag: str,
                 group_size: int, num_rows: int, part_sha256: list[str] | None = None) -> None:
    """Writes ``path`` naming the parts already written under ``tag`` (every shard of ``group_size``; their
    digests as :func:`write_item_part` returned them, else read here), then removes the folders of older
    parts."""
    parts = [item_part_file(path, tag, k, group_size) for k in range(group_size)]
    digests = part_sha256 if part_sha256 is not None else [file_sha256(f) for f in parts]
    if len(digests) != group_size:
        raise ValueError(f"{len(digests)} part digests for {group_size} parts")
    files = [f.relative_to(path.parent).as_posix() for f in parts]
    export_state(dense_state, cfg, ds, path, item_parts={"group_size": group_size, "num_rows": num_rows,
                                                          "files": files, "sha256": list(digests)})
    for old in item_parts_dir(path).iterdir():
        if old.name != tag and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)


def load_model_blob(path: Path) -> dict[str, Any]:
    """The artefact file's contents, read without running code; its format and version checked, and a
    version-3 file's content digest verified."""
    blob = load_checkpoint(path, "model")
    if blob.get("format") != FORMAT:
        raise UserError(f"{path} is not an exported grstack model")
    version = blob.get("version")
    if version in LEGACY_VERSIONS:
        return blob
    if not isinstance(version, int) or version > VERSION:
        raise UserError(f"{path} was written by a newer grstack (model format {version}; this one reads up to "
                        f"{VERSION}): load it with that version, or re-export it with `grstack train`")
    if version != VERSION:
        raise UserError(f"{path} has the unknown model format {version}: re-export it with `grstack train`")
    digest = blob.pop(DIGEST_KEY, None)
    if digest is None:
        raise UserError(f"model {path} carries no sha256 (a format-{VERSION} file always does: it was altered)")
    if content_sha256(blob) != digest:
        raise UserError(f"model {path}: sha256 mismatch (file corrupted or replaced)")
    return blob


def _item_table(path: Path, parts: dict[str, Any]) -> torch.Tensor:
    """The item table from the parts ``path`` names, each checked against its recorded digest (a version-3
    artefact records one per part)."""
    G, files = int(parts["group_size"]), list(parts["files"])
    digests = parts.get("sha256")
    if len(files) != G or (digests is not None and len(digests) != G):
        raise UserError(f"{path} names {len(files)} item-row parts for a table in {G}")
    table: torch.Tensor | None = None
    for k, name in enumerate(files):
        f = path.parent / name
        if not f.is_file():
            raise UserError(f"{path} names the item-row part {f}, which does not exist (copy the model's "
                            f"{item_parts_dir(path).name}/ folder with it)")
        part = load_checkpoint(f, "item-row part", None if digests is None else digests[k], path)
        if part.get("format") != PART_FORMAT or (part.get("shard"), part.get("group_size")) != (k, G):
            raise UserError(f"{f} is not part {k} of {G} of {path}'s item table")
        rows = part["rows"]
        if table is None:
            table = rows.new_empty((int(parts["num_rows"]), rows.shape[1]))
        table[k::G] = rows
    assert table is not None
    return table


def exported_state(path: Path, blob: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Every weight of the artefact ``path`` (its parts reassembled: this holds the whole item table)."""
    blob = load_model_blob(path) if blob is None else blob
    state = dict(blob["state_dict"])
    parts = blob.get("item_parts")
    if parts is not None:
        state[ITEM_KEY] = _item_table(path, parts)
    return state


def load_exported(path: Path) -> tuple[nn.Module, Config, list[str]]:
    """The exported model in eval mode, its config and its task names (either form)."""
    model, cfg, tasks, _ = load_exported_with_vocab(path)
    return model, cfg, tasks


def load_exported_with_vocab(path: Path) -> tuple[nn.Module, Config, list[str], dict[str, list[str]] | None]:
    """:func:`load_exported` plus the user features' vocabularies (field -> raw tokens of value ids 1, 2, ...;
    None when the model reads no user context): what a server maps request user features with."""
    blob = load_model_blob(path)
    try:
        cfg = Config.model_validate(blob["config"])
        tasks = list(blob["tasks"])
        fmap = ItemFeatureMap.from_blob(blob["item_features"]) if blob.get("item_features") else None
        users = dict(blob["user_features"]["sizes"]) if blob.get("user_features") else None
        model = build_model(cfg.model, blob["num_items"], cfg.data.max_len, num_tasks=len(tasks),
                            item_features=fmap, user_features=users)
        state = exported_state(path, blob)
        model.load_state_dict(state)
        vocab = ({k: list(v) for k, v in blob["user_features"]["vocab"].items()} if blob.get("user_features")
                 else None)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        # pydantic's ValidationError is a ValueError; load_state_dict's mismatches are RuntimeErrors
        lines = str(exc).strip().splitlines()
        raise UserError(f"{path} is a malformed grstack model ({type(exc).__name__}: "
                        f"{lines[0] if lines else ''})") from None
    model.eval()
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

"""Sequence models over jagged batches (HSTU, FuXi-α, and SASRec as the baseline) and their exported artefact.

Other packages import from here: the models, ``build_model``, and the artefact's format (export, load,
the run directory's file names). See docs/architecture.md.
"""

from __future__ import annotations

from grstack.runtime.model.artifact import (
    BEST_MODEL,
    DATASET_DIR,
    atomic_torch_save,
    export_model,
    export_parts,
    export_state,
    exported_state,
    item_feature_map,
    item_parts_dir,
    load_checkpoint,
    load_exported,
    load_exported_with_vocab,
    load_model_blob,
    resolve_model_file,
    task_names,
    write_item_part,
)
from grstack.runtime.model.build import build_model
from grstack.runtime.model.fuxi import FuXiAlpha
from grstack.runtime.model.hstu import HSTU
from grstack.runtime.model.item_rows import ITEM_INIT_STD, ExternalItemRows, initial_item_rows
from grstack.runtime.model.sasrec import SASRec
from grstack.runtime.model.side_features import ItemFeatureMap, UserContextLayout, batch_keys

__all__ = [
    "BEST_MODEL",
    "DATASET_DIR",
    "HSTU",
    "ITEM_INIT_STD",
    "ExternalItemRows",
    "FuXiAlpha",
    "ItemFeatureMap",
    "SASRec",
    "UserContextLayout",
    "atomic_torch_save",
    "batch_keys",
    "build_model",
    "export_model",
    "export_parts",
    "export_state",
    "exported_state",
    "initial_item_rows",
    "item_feature_map",
    "item_parts_dir",
    "load_checkpoint",
    "load_exported",
    "load_exported_with_vocab",
    "load_model_blob",
    "resolve_model_file",
    "task_names",
    "write_item_part",
]

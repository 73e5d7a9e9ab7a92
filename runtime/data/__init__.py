"""Sequence datasets: the Parquet format, importers, the synthetic generator, the leave-one-out split and
the jagged batch (docs/architecture.md §2).

Other packages import from here, never a submodule: ``SequenceDataset`` and ``read_dataset`` /
``write_dataset`` / ``from_sequences``; ``load_source`` (the dataset a config names) and
``known_item_count``; ``select_features`` (the side-feature fields a config uses); ``list_pieces`` / ``deal`` / ``RankShare`` / ``epoch_order`` (one rank's share of a
Parquet dataset, ``data.read: shard``), ``fingerprint`` and ``metadata_only``; ``LeaveOneOut`` and
``ranges_index``; ``JaggedBatch`` and ``append_candidates``; ``resolve_source``
(``fetched:NAME`` data sources, ``grstack data fetch``). Exports load lazily, so importing this package
(as ``grstack --help`` does, through ``data.cli``) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.data.candidates import append_candidates, exposure_labels
    from grstack.runtime.data.dataset import (
        SequenceDataset,
        from_sequences,
        read_dataset,
        read_meta,
        write_dataset,
    )
    from grstack.runtime.data.fetch import resolve_source
    from grstack.runtime.data.jagged import JaggedBatch
    from grstack.runtime.data.shards import (
        RankShare,
        deal,
        epoch_order,
        fingerprint,
        list_pieces,
        metadata_only,
    )
    from grstack.runtime.data.source import known_item_count, load_source, select_features
    from grstack.runtime.data.splits import LeaveOneOut, ranges_index
    from grstack.runtime.data.synth import synthesize

_EXPORTS = {
    "SequenceDataset": "grstack.runtime.data.dataset",
    "from_sequences": "grstack.runtime.data.dataset",
    "read_dataset": "grstack.runtime.data.dataset",
    "read_meta": "grstack.runtime.data.dataset",
    "write_dataset": "grstack.runtime.data.dataset",
    "load_source": "grstack.runtime.data.source",
    "known_item_count": "grstack.runtime.data.source",
    "select_features": "grstack.runtime.data.source",
    "LeaveOneOut": "grstack.runtime.data.splits",
    "ranges_index": "grstack.runtime.data.splits",
    "JaggedBatch": "grstack.runtime.data.jagged",
    "append_candidates": "grstack.runtime.data.candidates",
    "exposure_labels": "grstack.runtime.data.candidates",
    "RankShare": "grstack.runtime.data.shards",
    "deal": "grstack.runtime.data.shards",
    "epoch_order": "grstack.runtime.data.shards",
    "fingerprint": "grstack.runtime.data.shards",
    "list_pieces": "grstack.runtime.data.shards",
    "metadata_only": "grstack.runtime.data.shards",
    "synthesize": "grstack.runtime.data.synth",
    "resolve_source": "grstack.runtime.data.fetch",
}

__all__ = [
    "JaggedBatch",
    "LeaveOneOut",
    "RankShare",
    "SequenceDataset",
    "append_candidates",
    "deal",
    "epoch_order",
    "exposure_labels",
    "fingerprint",
    "from_sequences",
    "known_item_count",
    "list_pieces",
    "load_source",
    "metadata_only",
    "ranges_index",
    "read_dataset",
    "read_meta",
    "resolve_source",
    "select_features",
    "synthesize",
    "write_dataset",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

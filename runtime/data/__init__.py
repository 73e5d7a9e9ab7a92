"""Sequence datasets: the Parquet format, importers, the synthetic generator and statistics.

``import_dataset(fmt, src, **opts)``, ``synthesize(preset, seed, **overrides)`` and
``read_dataset(dir)`` each return a validated, time-ordered ``SequenceDataset``; ``write_dataset`` writes
one atomically; ``dataset_stats`` summarises one. Exports load lazily, so importing this package (as
``grstack --help`` does) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.data.dataset import SequenceDataset, read_dataset, read_meta, write_dataset
    from grstack.runtime.data.importers import import_dataset
    from grstack.runtime.data.stats import dataset_stats
    from grstack.runtime.data.synth import synthesize

_EXPORTS = {
    "SequenceDataset": "grstack.runtime.data.dataset",
    "read_dataset": "grstack.runtime.data.dataset",
    "read_meta": "grstack.runtime.data.dataset",
    "write_dataset": "grstack.runtime.data.dataset",
    "import_dataset": "grstack.runtime.data.importers",
    "synthesize": "grstack.runtime.data.synth",
    "dataset_stats": "grstack.runtime.data.stats",
}

__all__ = [
    "SequenceDataset",
    "dataset_stats",
    "import_dataset",
    "read_dataset",
    "read_meta",
    "synthesize",
    "write_dataset",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

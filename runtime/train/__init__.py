"""The trainer (one, for every world size), its batch schedule, engine, launch and checkpoints
(docs/architecture.md §4).

Other packages import from here, never a submodule: ``train`` and ``train_distributed`` (a run),
``format_summary`` (its one-paragraph report), ``call_ranks`` (a function on N local ranks), the batch
``Schedule`` / ``Preparer``, ``DistContext``, ``audit_collectives`` (the cross-rank order of collectives),
``imbalance`` / ``measured_balance`` and the benchmark harness's ``with_overrides`` / ``max_abs_diff``, ``cluster_time_per_batch`` (the clustering's host cost), and ``build_engine`` (the engine of a rank, for benchmarks
that time its steps). Exports load lazily, so importing this package (as ``grstack --help`` does, through
``train.cli``) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.train.balance import imbalance, measured_balance
    from grstack.runtime.train.batching import Preparer, Schedule
    from grstack.runtime.train.cli import format_summary
    from grstack.runtime.train.collective_audit import audit_collectives
    from grstack.runtime.train.context import DistContext
    from grstack.runtime.train.harness import max_abs_diff, with_overrides
    from grstack.runtime.train.launch import call_ranks, train_distributed
    from grstack.runtime.train.microbatching import cluster_time_per_batch
    from grstack.runtime.train.trainer import build_engine, train

_EXPORTS = {
    "imbalance": "grstack.runtime.train.balance",
    "measured_balance": "grstack.runtime.train.balance",
    "Preparer": "grstack.runtime.train.batching",
    "Schedule": "grstack.runtime.train.batching",
    "audit_collectives": "grstack.runtime.train.collective_audit",
    "format_summary": "grstack.runtime.train.cli",
    "DistContext": "grstack.runtime.train.context",
    "max_abs_diff": "grstack.runtime.train.harness",
    "with_overrides": "grstack.runtime.train.harness",
    "call_ranks": "grstack.runtime.train.launch",
    "train_distributed": "grstack.runtime.train.launch",
    "cluster_time_per_batch": "grstack.runtime.train.microbatching",
    "train": "grstack.runtime.train.trainer",
    "build_engine": "grstack.runtime.train.trainer",
}

__all__ = [
    "DistContext",
    "Preparer",
    "Schedule",
    "audit_collectives",
    "build_engine",
    "call_ranks",
    "cluster_time_per_batch",
    "format_summary",
    "imbalance",
    "max_abs_diff",
    "measured_balance",
    "train",
    "train_distributed",
    "with_overrides",
]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The row-sharded item table (docs/architecture.md §4): the sharding plan, the lookup protocol, the shard
optimizers and ``Comm`` (collectives on one process group).

Other packages import from here, never a submodule. Only ``train`` and ``bench`` use this package and no
``cli`` module imports it, so the exports are imported eagerly.
"""

from __future__ import annotations

from grstack.runtime.embedding.comm import CollectiveError, Comm, CommEvent, CommLog, attach_log
from grstack.runtime.embedding.optim import RowWiseAdagrad, fused_adamw, make_sparse_optimizer
from grstack.runtime.embedding.plan import ShardingPlan
from grstack.runtime.embedding.sharded import (
    ActiveRows,
    LookupUnit,
    RoutedBatch,
    ShardedEmbedding,
    make_unit,
    merge_rows,
    union_by_mask,
)

__all__ = [
    "ActiveRows",
    "CollectiveError",
    "Comm",
    "CommEvent",
    "CommLog",
    "LookupUnit",
    "RoutedBatch",
    "RowWiseAdagrad",
    "ShardedEmbedding",
    "ShardingPlan",
    "attach_log",
    "fused_adamw",
    "make_sparse_optimizer",
    "make_unit",
    "merge_rows",
    "union_by_mask",
]

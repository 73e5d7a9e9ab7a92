"""Functions the multi-process tests run on every rank (through ``launch.call_ranks``); children import
this module from the tests folder (``DIST_ENV`` puts it on their PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TESTS_DIR = str(Path(__file__).resolve().parent)
DIST_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)}


def rank_ids(rank: int, step: int, num_rows: int, n: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, num_rows, (n,), generator=g)


def rank_grads(rank: int, step: int, u: int, shape):
    import torch

    g = torch.Generator().manual_seed(7919 * step + 31 * rank + u)
    return torch.randn(shape, generator=g)


def sharded_lookup_and_update(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Two steps of deduplicated lookup + gradient + sparse update on a random table; returns what the test
    needs to redo the same arithmetic on one dense table."""
    import torch

    from grstack.runtime.embedding.optim import make_sparse_optimizer
    from grstack.runtime.embedding.plan import ShardingPlan
    from grstack.runtime.embedding.sharded import ShardedEmbedding, make_unit
    from grstack.runtime.train.context import DistContext

    rows, dim = payload["rows"], payload["dim"]
    ctx = DistContext(env, torch.device("cpu"), payload["group"], 30.0)
    plan = ShardingPlan.make(rows, dim, ctx.world_size, payload["group"])
    full = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    shard = full[plan.shard_of(ctx.rank) :: plan.group_size].clone()
    table = ShardedEmbedding(plan, ctx.rank, shard, make_sparse_optimizer(payload["optimizer"], shard, 0.1))
    looked_up = []
    for step in range(2):
        ids_a = rank_ids(ctx.rank, step, rows, 40)
        negs = rank_ids(ctx.rank + 100, step, rows, 25)
        unit_a, inv_a, _ = make_unit(ids_a)
        unit_b, inv_bf, inv_bh = make_unit(ids_a[:5], negs)
        rb = table.route([unit_a, unit_b], ctx.sparse_fwd)
        table.retrieve(rb)
        rows_a = table.send_rows(rb, unit_a, ctx.sparse_fwd, fp16=False)
        rows_b = table.send_rows(rb, unit_b, ctx.sparse_fwd, fp16=True)
        looked_up.append({"ids": ids_a, "rows": rows_a[inv_a], "negs": negs, "neg_rows": rows_b[inv_bh],
                          "head_rows": rows_b[inv_bf]})
        for u, unit in enumerate((unit_a, unit_b)):
            table.send_grads(rb, unit, rank_grads(ctx.rank, step, u, (unit.num_keys, dim)), ctx.sparse_fwd)
        table.apply(rb, ctx.replica)
    return {"looked_up": looked_up, "shard": table.weight.clone(), "table": table.full_table(ctx.world)}


def run_modes_per_group_size(env: Any, payload: dict[str, Any]) -> dict[int, Any]:
    """``harness.run_modes`` once per ``distributed.sparse_group_size`` in ``payload["group_sizes"]``, in one
    gang (one process start for all of them: each run builds its own sparse and replica groups on the same
    world). Returns {group size: run_modes' result}."""
    from grstack.runtime.train.harness import run_modes, with_overrides
    from grstack.runtime.training_config import Config

    base = Config.model_validate(payload["config"])
    out = {}
    for group in payload["group_sizes"]:
        cfg = with_overrides(base, {"distributed.sparse_group_size": group})
        out[group] = run_modes(env, {**payload, "config": cfg.model_dump(mode="json"),
                                     "modes": payload["modes"][str(group)]})
    return out

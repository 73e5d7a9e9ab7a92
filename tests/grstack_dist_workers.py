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


def eval_dataset(num_users: int, num_items: int, seed: int = 0):
    """ML-100K-like sequences (lengths 3..300, Zipf-popular items, repeats included)."""
    import numpy as np

    from grstack.runtime.data import from_sequences

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, num_items + 1) ** 0.8
    weights /= weights.sum()
    users, items, ts = [], [], []
    for u in range(num_users):
        n = int(rng.integers(3, 301)) if u % 7 else int(rng.integers(3, 6))
        users.append(u)
        items.append(rng.choice(num_items, size=n, p=weights) + 1)
        ts.append(1_600_000_000 + np.cumsum(rng.integers(1, 3600, size=n)))
    return from_sequences(users, items, ts, num_items=num_items, name="ml100k-like")


def sharded_vs_full_ranks(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """On every rank of ``ctx``: ``sharded_eval_ranks`` over this rank's users (uneven counts: rank r takes
    every W-th user from r, the last rank only the first third of its users) and ``eval_ranks`` on the whole
    model for the same users. Some item rows are copies of others (exact ties across shards). With
    ``payload["features"]`` the items carry side features, whose rows follow the items' in the table."""
    import numpy as np
    import torch
    from grstack_testing import with_item_features

    from grstack.runtime.data import LeaveOneOut
    from grstack.runtime.embedding import ShardedEmbedding, ShardingPlan, make_sparse_optimizer
    from grstack.runtime.eval import eval_ranks
    from grstack.runtime.model import build_model, item_feature_map
    from grstack.runtime.train.sharded_eval import sharded_eval_ranks
    from grstack.runtime.training_config import ModelConfig

    ds = eval_dataset(payload["num_users"], payload["num_items"])
    fmap = item_feature_map(with_item_features(ds)) if payload.get("features") else None
    split = LeaveOneOut(ds)
    mcfg = ModelConfig.model_validate(payload["model"])
    max_len, bs = payload["max_len"], payload["batch_size"]
    torch.manual_seed(0)
    full = build_model(mcfg, ds.num_items, max_len, item_features=fmap)
    with torch.no_grad():
        w = full.item_emb.weight
        w.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        w[5:12] = w[3]  # ties: rows on every shard equal to row 3
        w[20] = -w[3]
        w[42:242:2] = w[41:241:2]  # popular items with a twin on the next shard: a tie with the target
    dense = build_model(mcfg, ds.num_items, max_len, item_table=False, item_features=fmap)
    dense.load_state_dict({k: v for k, v in full.state_dict().items() if k != "item_emb.weight"})
    W = ctx.world_size
    plan = ShardingPlan.make(full.item_emb.weight.shape[0], mcfg.d_model, W, ctx.group_size)
    shard = full.item_emb.weight.detach()[plan.shard_of(ctx.rank) :: plan.group_size].clone()
    table = ShardedEmbedding(plan, ctx.rank, shard, make_sparse_optimizer("sgd", shard, 0.1))
    rows = np.arange(split.num_users)[ctx.rank :: W]
    if W > 1 and ctx.rank == W - 1:
        rows = rows[: len(rows) // 3]
    out: dict[str, Any] = {"rows_held_max": table.rows_held_max, "shard_rows": shard.shape[0]}
    for which in ("valid", "test"):
        out[which] = {
            "sharded": sharded_eval_ranks(dense, table, ctx, split, which, rows, max_len=max_len, batch_size=bs,
                                          device=torch.device("cpu")),
            "full": eval_ranks(full, split, which, rows, max_len=max_len, batch_size=bs,
                               device=torch.device("cpu"))}
    return out


def sharded_eval_on_ranks(env: Any, payload: dict[str, Any]) -> dict[int, Any]:
    """``sharded_vs_full_ranks`` once per sparse group size in ``payload["group_sizes"]`` (one gang)."""
    import torch

    from grstack.runtime.train.context import DistContext

    torch.set_num_threads(1)
    return {g: sharded_vs_full_ranks(DistContext(env, torch.device("cpu"), g, 120.0), payload)
            for g in payload["group_sizes"]}


def replica_union_both_ways(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """The replica sum of one shard's touched rows, with the union agreed by gathered keys and by the presence
    mask (``sharded.union_by_mask`` forced each way), for each case of payload ``cases`` (keys per rank)."""
    import torch

    from grstack.runtime.embedding import sharded
    from grstack.runtime.embedding.optim import make_sparse_optimizer
    from grstack.runtime.embedding.plan import ShardingPlan
    from grstack.runtime.train.context import DistContext

    rows, dim = payload["rows"], payload["dim"]
    ctx = DistContext(env, torch.device("cpu"), 1, 30.0)  # sparse groups of one: every rank a replica
    plan = ShardingPlan.make(rows, dim, ctx.world_size, 1)
    shard = torch.zeros(rows, dim)
    table = sharded.ShardedEmbedding(plan, ctx.rank, shard, make_sparse_optimizer("sgd", shard, 0.1))
    out: dict[str, Any] = {}
    real = sharded.union_by_mask
    try:
        for name, per_rank in payload["cases"].items():
            keys = torch.tensor(sorted(per_rank[ctx.rank]), dtype=torch.int64)
            grad = rank_grads(ctx.rank, 0, len(keys), (len(keys), dim))
            got = {}
            for way, forced in (("by_keys", False), ("by_mask", True)):
                sharded.union_by_mask = lambda *a, f=forced: f  # type: ignore[assignment]
                got[way] = table.reduce_replicas(keys, grad, ctx.replica)
            sharded.union_by_mask = real
            got["auto"] = table.reduce_replicas(keys, grad, ctx.replica)
            out[name] = {"keys": keys, "grad": grad, **got}
    finally:
        sharded.union_by_mask = real
    return out

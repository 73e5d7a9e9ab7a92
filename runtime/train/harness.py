"""Fixed-step runs of the distributed engine under several settings, from the same initial state and on the
same data, without a run directory: the equivalence checks (DBP on/off, FWP N vs 1, clustering) and the
``grstack bench train`` measurements both use it. Called on every rank through ``launch.call_ranks``.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import torch

from grstack.runtime.data import LeaveOneOut, load_source
from grstack.runtime.device import host_sync_counter
from grstack.runtime.embedding import CommLog, attach_log
from grstack.runtime.model import task_names
from grstack.runtime.train.batching import BatchStream
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.launch import rank_device
from grstack.runtime.train.trainer import build_engine, make_plan
from grstack.runtime.training_config import Config


def with_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    tree = cfg.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = tree
        *path, last = dotted.split(".")
        for key in path:
            node = node[key]
        node[last] = value
    return Config.model_validate(tree)


def _target(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def run_modes(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """payload: ``config`` (a Config dump), ``modes`` ({name: {dotted key: value}}), ``steps``, and
    ``params`` (return final parameters, on rank 0). Returns {mode: {"records": [...], "params": ...,
    "shard": this rank's shard (``shards`` true), "comm_log": every collective of the steps (``comm_log``
    true; ``embedding.CommLog`` events as dicts, step markers 0..steps-1), "batch_stats": ``on_batch``
    ("module:function", called as ``f(batch, cfg, payload)`` on each step's batch; a read-only observer)
    results}}. With ``comm_log`` also "backend" (the process groups' backend) and "comm_groups" ({name: member
    ranks} of this rank's live Comms and their meta twins: ``audit_collectives``' ``members``). With
    ``host_syncs``, each step's host syncs as ``device.host_sync_counter`` counts them (the engine's
    ``count_host_syncs``, or a counter around the step for an engine without it): its record's "host_syncs"
    and "host_syncs_counter", and the mode's result "host_syncs_counter" (the counter's name). With
    ``interleave``, see ``_run_interleaved``."""
    base = Config.model_validate(payload["config"])
    ctx = DistContext(env, rank_device(base, env), base.distributed.sparse_group_size, base.distributed.timeout_s)
    ds = load_source(base.data)
    split = LeaveOneOut(ds, min_len=base.data.min_len, block=base.ranking_block())
    tasks = task_names(ds)
    if payload.get("interleave", False):
        return _run_interleaved(ctx, base, payload, split, tasks, ds.num_items)
    out: dict[str, Any] = {}
    for name, overrides in payload["modes"].items():
        cfg = with_overrides(base, overrides)
        built = build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items), split, tasks)
        positions = itertools.islice(built.schedule.positions(0, 0, 0), payload["steps"])
        stream = BatchStream(positions, built.preparer, cfg.negatives.prefetch, cfg.negatives.background,
                             device=ctx.device)
        records = []
        ctx.world.barrier()
        log = CommLog() if payload.get("comm_log", False) else None
        attach_log(ctx.comms, log)
        observe = _target(payload["on_batch"]) if payload.get("on_batch") else None
        stats: list[Any] = []
        counter_name = None
        count = payload.get("host_syncs", False)
        # the engine counts its own steps where it can (one counter: CUDA's sync debug mode does not nest)
        engine_counts = count and hasattr(built.engine, "count_host_syncs")
        if engine_counts:
            built.engine.count_host_syncs = True
        while (batch := stream.next()) is not None:
            if log is not None:
                log.mark(len(records))
            if observe is not None:
                stats.append(observe(batch, cfg, payload))
            upcoming = stream.peek()
            if count and not engine_counts:
                with host_sync_counter(ctx.device) as syncs:
                    record = built.engine.step(batch, upcoming, cfg.optim.lr)
                record.update(host_syncs=syncs.count, host_syncs_counter=syncs.counter)
            else:
                record = built.engine.step(batch, upcoming, cfg.optim.lr)
            counter_name = record.get("host_syncs_counter", counter_name)
            records.append(record)
        if log is not None:
            log.mark(None)
        built.engine.drain()
        attach_log(ctx.comms, None)
        built.engine.close()
        stream.close()
        result: dict[str, Any] = {"records": records}
        if log is not None:
            result["comm_log"] = log.to_dicts()
            result["backend"] = ctx.backend
            result["comm_groups"] = {c.name: list(c.ranks) for comm in ctx.comms for c in (comm, comm.meta)
                                     if c.live}
        if counter_name is not None:
            result["host_syncs_counter"] = counter_name
        if observe is not None:
            result["batch_stats"] = stats
        if payload.get("params", True):
            table = built.table.full_table(ctx.world)
            if ctx.rank == 0:
                result["params"] = {**{k: v.detach().clone() for k, v in built.model.state_dict().items()},
                                    "item_emb.weight": table}
        if payload.get("shards", False):
            result["shard"] = built.table.weight.clone()
        out[name] = result
    ctx.world.barrier()
    return out


def _run_interleaved(ctx: DistContext, base: Config, payload: dict[str, Any], split: LeaveOneOut,
                     tasks: list[str], num_items: int) -> dict[str, Any]:
    """Every mode's engine built up front (each from the same initial state), then their steps in turn: step
    0 of every mode, step 1 of every mode, ... so the modes are timed under the same machine load. Modes
    must not prefetch across steps (``pipeline.dbp`` / ``semi_async`` off). Returns {mode: {"records"}}."""
    runs = []
    for name, overrides in payload["modes"].items():
        cfg = with_overrides(base, overrides)
        if cfg.pipeline.dbp or cfg.pipeline.semi_async:
            raise ValueError(f"interleaved mode {name}: dual-buffer and semi-async prefetch across steps")
        built = build_engine(cfg, ctx, make_plan(cfg, ctx, num_items), split, tasks)
        positions = itertools.islice(built.schedule.positions(0, 0, 0), payload["steps"])
        stream = BatchStream(positions, built.preparer, cfg.negatives.prefetch, cfg.negatives.background,
                             device=ctx.device)
        runs.append((name, cfg, built, stream, []))
    ctx.world.barrier()
    live = list(runs)
    while live:
        for run in list(live):
            _, cfg, built, stream, records = run
            if (batch := stream.next()) is None:
                live.remove(run)
                continue
            records.append(built.engine.step(batch, None, cfg.optim.lr))
    for _, _, built, stream, _ in runs:
        built.engine.close()
        stream.close()
    ctx.world.barrier()
    return {name: {"records": records} for name, _, _, _, records in runs}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)

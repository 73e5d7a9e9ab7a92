"""Rank functions of the pipeline-order tests (through ``launch.call_ranks``; ``DIST_ENV`` puts this folder
on the children's PYTHONPATH): steps of each mode with the engine's host-sync count, the reads made inside
the model's forward and the table optimizer (attributed separately), and the lanes' trace."""

from __future__ import annotations

import itertools
from typing import Any


def counted_steps(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """payload: ``config``, ``modes`` ({name: overrides}), ``steps``. Returns {mode: {"steps": [(engine
    step's count, reads inside model.encode, reads inside the table optimizer's step, counter name)],
    "trace": the lanes' trace}}."""
    import torch

    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.model import task_names
    from grstack.runtime.streams import StreamSet
    from grstack.runtime.train.batching import BatchStream
    from grstack.runtime.train.context import DistContext
    from grstack.runtime.train.harness import with_overrides
    from grstack.runtime.train.trainer import build_engine, make_plan
    from grstack.runtime.training_config import Config

    base = Config.model_validate(payload["config"])
    cpu = torch.device("cpu")
    ctx = DistContext(env, cpu, base.distributed.sparse_group_size, base.distributed.timeout_s)
    ds = load_source(base.data)
    split = LeaveOneOut(ds, min_len=base.data.min_len, block=base.ranking_block())
    tasks = task_names(ds)
    out: dict[str, Any] = {}
    for name, overrides in payload["modes"].items():
        cfg = with_overrides(base, overrides)
        built = build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items), split, tasks)
        inner = {"model": 0, "table": 0}
        built.model.encode = _attributed(built.model.encode, inner, "model")
        built.table.optimizer.step = _attributed(built.table.optimizer.step, inner, "table")
        trace: list[Any] = []
        built.engine.use_lanes(StreamSet.for_device(cpu, trace=trace))
        built.engine.count_host_syncs = True
        positions = itertools.islice(built.schedule.positions(0, 0, 0), payload["steps"])
        stream = BatchStream(positions, built.preparer, cfg.negatives.prefetch, cfg.negatives.background)
        steps = []
        ctx.world.barrier()
        while (batch := stream.next()) is not None:
            inner["model"] = inner["table"] = 0
            rec = built.engine.step(batch, stream.peek(), cfg.optim.lr)
            steps.append((rec["host_syncs"], inner["model"], inner["table"], rec["host_syncs_counter"]))
        built.engine.drain()
        built.engine.close()
        stream.close()
        out[name] = {"steps": steps, "trace": trace}
    ctx.world.barrier()
    return out


def _attributed(fn: Any, counts: dict[str, int], key: str) -> Any:
    """``fn`` whose counted host reads are also added to ``counts[key]`` (the step's counter still sees
    them: counters nest)."""
    import torch

    from grstack.runtime.device import host_sync_counter

    def run(*args: Any, **kwargs: Any) -> Any:
        with host_sync_counter(torch.device("cpu")) as c:
            result = fn(*args, **kwargs)
        counts[key] += c.count
        return result

    return run

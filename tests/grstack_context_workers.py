"""What the process-group tests run on every rank (through ``launch.call_ranks``, with
``grstack_dist_workers.DIST_ENV`` putting this folder on the children's PYTHONPATH)."""

from __future__ import annotations

from typing import Any


def describe_groups(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """The rank's DistContext on gloo: each Comm's name, members, device, liveness and twin, and the
    seconds each has spent in collectives right after start-up (the warm-up)."""
    import torch

    from grstack.runtime.train.context import DistContext

    ctx = DistContext(env, torch.device("cpu"), payload["group"], 60.0)

    def row(c: Any) -> dict[str, Any]:
        return {"name": c.name, "ranks": list(c.ranks), "device": str(c.device), "live": c.live,
                "meta": c.meta.name, "seconds": c.seconds}

    out = {"comms": [row(c) for c in ctx.comms], "device_comms": [c.name for c in ctx.device_comms]}
    ctx.close()
    return out

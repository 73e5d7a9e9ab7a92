"""What the multi-process calibration test runs on every rank (through ``launch.call_ranks``, with
``grstack_dist_workers.DIST_ENV`` putting this folder on the children's PYTHONPATH)."""

from __future__ import annotations

from typing import Any


def calibrate_on_ranks(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Builds the rank's engine as the trainer does, calibrates (the trainer's call), sets the weights and
    returns the fit, the split of the first ``steps`` global batches, and whether the calibration left the
    global RNG and the model's gradients alone."""
    import torch

    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.model import task_names
    from grstack.runtime.train.calibrate import calibrate, weights
    from grstack.runtime.train.context import DistContext
    from grstack.runtime.train.launch import rank_device
    from grstack.runtime.train.trainer import build_engine, make_plan
    from grstack.runtime.training_config import Config

    cfg = Config.model_validate(payload["config"])
    if cfg.train.num_threads:  # as the trainer does (else the launcher's share of the cores: rank_device)
        torch.set_num_threads(cfg.train.num_threads)
    ctx = DistContext(env, rank_device(cfg, env), 0, 60.0)
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len)
    built = build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items), split, task_names(ds))
    rng = torch.get_rng_state()
    fitted = calibrate(built.engine, built.schedule, built.preparer, ctx, repeats=payload["repeats"])
    rng_kept = torch.equal(rng, torch.get_rng_state())
    w = weights(fitted["a"], fitted["b"])
    if w is not None:
        built.schedule.set_weights(*w)
    s = built.schedule
    parts = [[p.tolist() for p in s.parts(s.step_rows(0, i))] for i in range(payload["steps"])]
    built.engine.close()
    return {"fitted": fitted, "weights": w, "parts": parts, "rng_kept": rng_kept, "threads": torch.get_num_threads(),
            "grads_untouched": all(p.grad is None for p in built.model.parameters())}

"""Learning rate per optimizer update and the updates of a run (gradient accumulation windows).

Pure functions of the config and the batch schedule, so a resumed run continues the same curve. An update
is the end of an accumulation window of ``train.grad_accum_steps`` batches; a window never crosses the end
of an epoch (the last one of an epoch may be shorter) or the run's last batch.
"""

from __future__ import annotations

import math

from grstack.runtime.training_config import OptimConfig


def learning_rate(update: int, total_updates: int, o: OptimConfig) -> float:
    """The rate of update ``update`` (0-based) of ``total_updates``: linear warm-up over
    ``o.warmup_steps`` updates, then constant or a cosine / linear decay to ``o.min_lr_ratio * o.lr`` at the
    last update."""
    if o.warmup_steps and update < o.warmup_steps:
        return o.lr * (update + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(1, total_updates - 1 - o.warmup_steps)
    progress = min(1.0, max(0.0, (update - o.warmup_steps) / span))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1.0 - progress
    return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * shape)


def window_bounds(step_in_epoch: int, steps_in_epoch: int, accum: int) -> tuple[int, int]:
    """(first, end) batch indices, within the epoch, of the accumulation window holding ``step_in_epoch``."""
    first = step_in_epoch - step_in_epoch % accum
    return first, min(first + accum, steps_in_epoch)


def count_updates(steps_per_epoch: list[int], accum: int, max_batches: int | None = None) -> int:
    """Optimizer updates of a run whose epochs have these batch counts, stopping after ``max_batches``
    batches in all (the last, cut window still updates)."""
    total = 0
    left = max_batches if max_batches is not None else sum(steps_per_epoch)
    for n in steps_per_epoch:
        take = min(n, left)
        total += -(-take // accum)
        left -= take
        if left <= 0:
            break
    return total

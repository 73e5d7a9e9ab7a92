"""The balancer's cost weights from measured times (``balance.calibrate``, ``balance.profile``).

The balancer splits a global batch so every rank's ``sum(a·L + b·L²)`` is about equal; only the ratio b/a
matters. Calibration measures it at start-up instead of trusting the defaults (a=1, b=0.01):

1. Lengths: a few distinct history lengths spanning the training data's (its p10, quartiles, p90 and evenly
   spaced points from the p90 to the longest), each the length of a real training row (the row nearest
   to it); the balancer's L adds the ranking candidates, and so does every length reported here.
2. Timing: the engine's own forward and loss (``Engine._forward``: the dense model on the run's device, the
   real sampled softmax and ranking head, ``train.precision``) and the backward (``torch.autograd.grad``:
   the same gradients as a step's backward, written nowhere) of that one row, prepared by the real
   ``Preparer`` on random item rows. One untimed round, then ``repeats`` rounds over every length (the
   lengths in turn, so a load change hits all of them alike). The clock (``timing_clock``): on CPU with one
   intra-op thread, the main thread's CPU time (what the rank computes, without the time the OS gives other
   processes: busy machines make wall times noisy); otherwise wall time, on an accelerator waiting for the
   device before and after. Every rank times (concurrently, as ranks train); the global RNG is left as it
   was, and nothing of the model or optimizer changes.
3. Fit: rank 0 takes the median of every rank's timings per length and fits ``ms = c + a·L + b·L²`` by
   non-negative least squares (exact: every active set of the three terms is solved and the best feasible
   fit kept). ``c`` is a timing's fixed cost (dispatch, the loss's set-up), which every rank pays once per
   step whatever its batch: it is not part of a sequence's cost, and without it the fit would fold it into
   a and b. The weights used are ``cost_a = 1``, ``cost_b = b / a`` (the units of the defaults: one token's
   linear cost), broadcast from rank 0 so every rank computes the same split.

The trainer keeps the fit (``a``, ``b`` in ms per token and per token², ``c``, ``r2``, ``lengths``, ``ms``,
``clock``) in the summary and every checkpoint's manifest (a resumed run splits by it again), and writes it as
``balance_profile.json`` in the run directory with the first checkpoint; ``balance.profile`` reuses such a
file (or any JSON object with non-negative ``a`` and ``b``) instead of timing.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from grstack.runtime.device import synchronize
from grstack.runtime.errors import UserError
from grstack.runtime.model import ITEM_INIT_STD
from grstack.runtime.train.batching import Preparer, Schedule
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.pipeline import Engine

PROFILE = "balance_profile.json"
PROFILE_FORMAT = "grstack-balance-profile"
REPEATS = 5


# -- the fit (pure) -------------------------------------------------------------------------------------------
def fit_cost(lengths: Any, ms: Any, intercept: bool = True) -> dict[str, float]:
    """Non-negative least squares of ``ms = c + a·L + b·L²`` (``intercept`` False: c = 0). Returns ``a``,
    ``b``, ``c`` and ``r2`` (1 - residual / total sum of squares about the mean of ``ms``)."""
    L = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    if L.shape != y.shape or L.ndim != 1:
        raise ValueError("lengths and ms must be 1-d and of one size")
    cols = {"c": np.ones_like(L), "a": L, "b": L * L}
    names = ["c", "a", "b"] if intercept else ["a", "b"]
    # scale the columns to unit norm so the solve is well conditioned at long lengths
    scale = {k: float(np.linalg.norm(cols[k])) or 1.0 for k in names}
    best: tuple[float, dict[str, float]] | None = None
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            X = np.stack([cols[k] / scale[k] for k in subset], axis=1)
            coef, *_ = np.linalg.lstsq(X, y, rcond=None)
            if np.any(coef < 0):
                continue
            sse = float(np.sum((X @ coef - y) ** 2))
            if best is None or sse < best[0] - 1e-15 * max(1.0, float(np.sum(y * y))):
                best = (sse, {k: float(v) / scale[k] for k, v in zip(subset, coef, strict=True)})
    sse, found = best if best is not None else (float(np.sum(y * y)), {})
    tss = float(np.sum((y - y.mean()) ** 2))
    return {"a": found.get("a", 0.0), "b": found.get("b", 0.0), "c": found.get("c", 0.0),
            "r2": 1.0 - sse / tss if tss > 0 else 1.0}


def weights(a: float, b: float) -> tuple[float, float] | None:
    """The balancer's (cost_a, cost_b) from fitted a and b: (1, b/a), or (0, 1) when a is 0; None when both
    are 0 (no cost grows with length: nothing to balance by)."""
    if a > 0:
        return 1.0, b / a
    if b > 0:
        return 0.0, 1.0
    return None


def calibration_lengths(lengths: np.ndarray, points: int = 4) -> np.ndarray:
    """Distinct target lengths spanning ``lengths``: the p10, quartiles and p90, and ``points`` evenly spaced
    from the p90 to the longest (the quadratic term shows at the long end)."""
    L = np.asarray(lengths, dtype=np.float64)
    if L.size == 0:
        return np.zeros(0, dtype=np.int64)
    q = np.percentile(L, [10, 25, 50, 75, 90])
    top = np.linspace(q[-1], L.max(), points)
    return np.unique(np.round(np.concatenate([q, top])).astype(np.int64))


def pick_rows(lengths: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """For each target, the first row whose length is nearest to it; rows of one length appear once."""
    L = np.asarray(lengths)
    rows, seen = [], set()
    for t in targets:
        r = int(np.argmin(np.abs(L - t)))
        if int(L[r]) not in seen:
            seen.add(int(L[r]))
            rows.append(r)
    return np.asarray(sorted(rows, key=lambda r: L[r]), dtype=np.int64)


# -- the timing -----------------------------------------------------------------------------------------------
def timing_clock(device: torch.device) -> tuple[str, Any]:
    """(name, clock in seconds) calibration times with: ``thread_cpu`` on CPU with one intra-op thread,
    else ``wall``."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return "thread_cpu", time.thread_time
    return "wall", time.perf_counter


class _OneRow:
    """What ``Preparer`` reads of a schedule, for a global batch of one training row on one rank."""

    def __init__(self, schedule: Schedule, row: int) -> None:
        self.split, self.lengths, self.extra_tokens = schedule.split, schedule.lengths, schedule.extra_tokens
        self._rows = np.array([row], dtype=np.int64)

    def step_rows(self, epoch: int, step: int) -> np.ndarray:
        return self._rows

    def parts(self, rows: np.ndarray, mode: str | None = None) -> list[np.ndarray]:
        return [np.arange(len(rows))]

    def costs(self, rows: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
        return np.zeros(len(parts))


def time_rows(engine: Engine, schedule: Schedule, preparer: Preparer, rows: np.ndarray,
              repeats: int = REPEATS) -> list[list[float]]:
    """Milliseconds of forward + loss + backward of each training row alone, ``repeats`` times each (after
    one untimed round): ``[row][repeat]``. Leaves the global RNG (CPU and the device's), the model, its
    gradients and the optimizers as they were."""
    cfg, device = engine.cfg, engine.device
    dim = engine.table.plan.dim
    prepared = []
    for row in rows.tolist():
        prep = Preparer(cast(Schedule, _OneRow(schedule, row)), cfg, 0, preparer.num_items, preparer.num_tasks,
                        preparer.ranking, preparer.item_features, preparer.context_layout)
        batch = prep(0, 0, 0)
        g = torch.Generator().manual_seed(row)

        def leaf(u: int, g: torch.Generator = g, batch: Any = batch) -> torch.Tensor:
            rows_u = torch.randn(batch.units[u].num_keys, dim, generator=g) * ITEM_INIT_STD
            return rows_u.to(device).requires_grad_(True)

        mb = batch.micro[0]
        item_rows = leaf(mb.unit)
        neg_rows = leaf(batch.neg_unit) if batch.neg_unit is not None else None
        inputs = [item_rows, *([neg_rows] if neg_rows is not None else []), *engine.dense_params]
        prepared.append((batch, mb, item_rows, neg_rows, inputs))

    def once(i: int) -> float:
        batch, mb, item_rows, neg_rows, inputs = prepared[i]
        synchronize(device)
        t0 = clock()
        loss, _, _ = engine._forward(batch, mb, item_rows, neg_rows)  # the engine's own loss path
        torch.autograd.grad(loss, inputs, allow_unused=True)
        synchronize(device)
        return 1e3 * (clock() - t0)

    clock = timing_clock(device)[1]
    out: list[list[float]] = [[] for _ in prepared]
    accel = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=accel, device_type=device.type if accel else "cuda"), torch.enable_grad():
        for i in range(len(prepared)):  # warm-up: allocator, first-call paths
            once(i)
        for _ in range(repeats):
            for i in range(len(prepared)):
                out[i].append(once(i))
    return out


def calibrate(engine: Engine, schedule: Schedule, preparer: Preparer, ctx: DistContext,
              repeats: int = REPEATS) -> dict[str, Any]:
    """Times the rows at ``calibration_lengths`` of the training data on every rank, fits on rank 0 and
    returns rank 0's fit on every rank: ``a``, ``b`` (ms per token, per token²), ``c`` (ms), ``r2``,
    ``lengths`` (the balancer's L: history + candidate tokens), ``ms`` (median per length over every rank's
    timings), ``ranks``, ``repeats``, ``device``, ``clock``. Call it on every rank (collective)."""
    # the lengths come from every rank's data; each rank times rows it holds (all of them, unless the data
    # is read sharded), the nearest to each
    own = schedule.own_rows()
    rows = own[pick_rows(schedule.lengths[own], calibration_lengths(schedule.lengths))] if len(own) else own
    times = time_rows(engine, schedule, preparer, rows, repeats) if len(rows) >= 2 else []
    lengths = (schedule.lengths[rows] + schedule.extra_tokens).tolist() if times else []
    gathered = cast(list[tuple[list[int], list[list[float]]]], ctx.world.all_gather_object((lengths, times)))
    result: dict[str, Any] | None = None
    if ctx.rank == 0:
        result = fit_pooled(gathered)
        result.update(ranks=ctx.world_size, repeats=repeats, device=str(engine.device),
                      clock=timing_clock(engine.device)[0])
    return cast(dict[str, Any], ctx.world.broadcast_object(result))


def fit_timings(lengths: np.ndarray, per_rank: list[Any]) -> dict[str, Any]:
    """The fit of the median (over ranks and repeats) per length; ``per_rank``: each rank's ``[row][repeat]``
    milliseconds. Fewer than two lengths: a, b = 0 (nothing to fit)."""
    L = [int(x) for x in lengths]
    if len(L) < 2:
        return {"a": 0.0, "b": 0.0, "c": 0.0, "r2": 0.0, "lengths": L, "ms": []}
    ms = [statistics.median(v for rank in per_rank for v in rank[i]) for i in range(len(L))]
    return {**fit_cost(L, ms), "lengths": L, "ms": ms}


def fit_pooled(per_rank: list[tuple[list[int], list[list[float]]]]) -> dict[str, Any]:
    """``fit_timings`` over every rank's own rows: ``per_rank`` holds each rank's (lengths, ``[row][repeat]``
    ms); timings of one length are pooled whichever rank took them (ranks holding the same data time the same
    rows, so this is ``fit_timings`` of those rows)."""
    pooled: dict[int, list[float]] = {}
    for lengths, times in per_rank:
        for L, ms in zip(lengths, times, strict=True):
            pooled.setdefault(int(L), []).extend(ms)
    L = sorted(pooled)
    return fit_timings(np.asarray(L, dtype=np.int64), [[pooled[x] for x in L]])


# -- profiles -------------------------------------------------------------------------------------------------
def write_profile(path: Path, fitted: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"format": PROFILE_FORMAT, **fitted}, indent=2) + "\n")
    tmp.replace(path)


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile's fit (at least non-negative numbers ``a`` and ``b``, not both 0); a UserError names what is
    wrong."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise UserError(f"balance.profile {p}: cannot read it ({exc.strerror or exc})") from None
    except ValueError:
        raise UserError(f"balance.profile {p}: not valid JSON") from None
    if not isinstance(data, dict):
        raise UserError(f"balance.profile {p}: expected a JSON object with the fitted a and b")
    for key in ("a", "b"):
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
            raise UserError(f"balance.profile {p}: {key!r} must be a non-negative number (got {v!r})")
    if weights(float(data["a"]), float(data["b"])) is None:
        raise UserError(f"balance.profile {p}: a and b are both 0")
    data.pop("format", None)
    return data

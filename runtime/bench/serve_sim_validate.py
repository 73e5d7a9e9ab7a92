"""The simulator judged against real runs it was not fitted to: the stored runs and the rules, fixed beforehand.

A validation directory holds a cost profile calibrated on pinned real runs (``grstack bench serve --calibrate``)
and a held-out real benchmark (``grstack bench serve ... --json``'s ``serve-bench.json``) measured at other seeds
and rates. The simulator replays each held-out point's traces (the same seeds) on the calibrated costs; each
point is judged by :class:`Rules`, and the knee (the QPS limit) by :func:`knee_check`.

The host's speed is measured, not assumed: a shared VM ran the same steps 10-25 % faster or slower from one run
to the next, more than the spread inside one. When the held-out run's step log is stored beside it
(``held-out-steps.json.gz``, the benchmark's ``serve-bench-steps.json.gz``), each point is predicted on the
calibrated costs scaled by how much slower the held-out run's *other* points ran than the profile says
(:func:`host_speed`; never the judged point's own steps).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grstack.runtime.serve import CostProfile

PROFILE_FILE = "cost-profile.json"
HELD_OUT_FILE = "held-out.json"
STEP_LOG_FILE = "held-out-steps.json.gz"  # the held-out run's serve-bench-steps.json.gz (optional)


@dataclass(frozen=True)
class Rules:
    """What "within" means, fixed before any prediction was compared.

    * P99: the prediction lies inside the measured repeats' spread [min, max] (a repeat that gave up has an
      infinite P99: the spread is then unbounded above, and a point whose median failed is matched only by a
      failing prediction).
    * Rates (hit rate, admitted share of trigger decisions, shed share of measured ranks) and compute per visit:
      within ``relative`` of the measured value, or ``absolute`` for a rate near 0.
    """

    relative: float = 0.05
    absolute: float = 0.02

    def close(self, measured: float | None, predicted: float | None, rate: bool) -> bool | None:
        if measured is None or predicted is None:
            return None
        tol = max(self.relative * abs(measured), self.absolute if rate else 0.0)
        return abs(predicted - measured) <= tol


@dataclass(frozen=True)
class HeldOutPoint:
    mode: str
    sweep: str
    length: int
    qps: float
    seeds: tuple[int, ...]
    measured: dict[str, Any]


@dataclass(frozen=True)
class ValidationSet:
    directory: Path
    profile_file: Path
    held_out_file: Path
    protocol: dict[str, Any]
    points: tuple[HeldOutPoint, ...]
    limits: dict[str, float | None]  # measured QPS limit per mode
    step_log: tuple[dict[str, Any], ...] = ()  # the held-out run's logged steps, per repeat (empty: none stored)

    def modes(self) -> list[str]:
        return sorted({p.mode for p in self.points})

    def steps(self, leave_out: HeldOutPoint | None = None, only: HeldOutPoint | None = None) -> list[dict[str, Any]]:
        """The held-out run's logged steps, every mode's, without those of ``leave_out``'s sweep value (its
        length and rate: the same traces, in every mode and sweep that shares them), or only ``only``'s."""
        from grstack.runtime.bench.serve import step_rows

        out: list[dict[str, Any]] = []
        for rep in self.step_log:
            value = (int(rep["length"]), float(rep["qps"]))
            if leave_out is not None and value == (leave_out.length, leave_out.qps):
                continue
            if only is not None and value != (only.length, only.qps):
                continue
            out += step_rows(rep["steps"])
        return out


def host_speed(vs: ValidationSet, profile: CostProfile,
               leave_out: HeldOutPoint | None = None) -> dict[str, Any] | None:
    """How much slower the held-out run's steps ran than ``profile`` says (its :meth:`CostProfile.slowdown`),
    from every point but ``leave_out``'s; ``None`` without a stored step log."""
    if not vs.step_log:
        return None
    return _speed(profile, vs.steps(leave_out),
                  left_out=None if leave_out is None else f"{leave_out.length}@{leave_out.qps:g}")


def _speed(profile: CostProfile, steps: list[dict[str, Any]], **about: Any) -> dict[str, Any]:
    """``steps``' slowdown against ``profile`` (:meth:`CostProfile.slowdown`), how many steps counted, and
    ``about`` (which steps they were)."""
    factor, n = profile.slowdown(steps)
    return {"factor": factor, "steps": n, **about}


SPEEDS = ("neighbours", "others", "calibration", "own")  # how a held-out point's host speed is taken
NEIGHBOURS = 3  # repeats each side of a point, in run order, whose steps give its speed ("neighbours")


def neighbour_speed(vs: ValidationSet, profile: CostProfile, point: HeldOutPoint,
                    k: int = NEIGHBOURS) -> dict[str, Any] | None:
    """How much slower than ``profile`` the host ran the ``k`` repeats logged just before ``point``'s sweep value
    and the ``k`` just after it, in run order (never its own): the host's speed drifts from minute to minute,
    so the repeats nearest in time say most about it. ``None`` without a stored step log."""
    from grstack.runtime.bench.serve import step_rows

    if not vs.step_log:
        return None
    value = (point.length, point.qps)
    keys = [(int(r["length"]), float(r["qps"])) for r in vs.step_log]
    mine = [i for i, key in enumerate(keys) if key == value]
    if not mine:
        return host_speed(vs, profile, point)
    before = [i for i in range(mine[0] - 1, -1, -1) if keys[i] != value][:k]
    after = [i for i in range(mine[-1] + 1, len(keys)) if keys[i] != value][:k]
    steps = [s for i in sorted(before + after) for s in step_rows(vs.step_log[i]["steps"])]
    return _speed(profile, steps, left_out=f"{point.length}@{point.qps:g}", repeats=len(before) + len(after))


def point_speed(vs: ValidationSet, profile: CostProfile, point: HeldOutPoint, how: str) -> dict[str, Any] | None:
    """A held-out point's host speed, taken as ``how`` says (``SPEEDS``; None: the calibration's)."""
    if how == "neighbours":
        return neighbour_speed(vs, profile, point)
    if how == "others":
        return host_speed(vs, profile, point)
    if how == "own":
        return own_speed(vs, profile, point)
    if how == "calibration":
        return None
    raise ValueError(f"a host speed is one of {SPEEDS}, got {how!r}")


def own_speed(vs: ValidationSet, profile: CostProfile, point: HeldOutPoint) -> dict[str, Any] | None:
    """The diagnostic's speed (``--speed own``): measured on ``point``'s own steps, so that a prediction
    has the costs the real run had at that time and what is judged is the simulator's queueing of them. Not a
    prediction of the point: its compute per visit follows from these costs and is not judged."""
    if not vs.step_log:
        return None
    return _speed(profile, vs.steps(only=point), only=f"{point.length}@{point.qps:g}")


def unjudge_compute(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with its compute-per-visit check kept but not judged (within None): circular at own speed."""
    checks = dict(entry["checks"])
    checks["compute_ms_per_visit"] = {**checks["compute_ms_per_visit"], "within": None}
    return {**entry, "checks": checks}


def _fail(path: Path, problem: str) -> Exception:
    from grstack.runtime.errors import UserError

    return UserError(f"{path}: {problem}")


def load_validation(directory: str | Path) -> ValidationSet:
    """The stored runs in ``directory``; one ``error:`` naming the file when one is missing or malformed."""
    d = Path(directory)
    prof, held = d / PROFILE_FILE, d / HELD_OUT_FILE
    for p in (prof, held):
        if not p.is_file():
            raise _fail(p, "no such file (the validation needs a calibrated profile and a held-out run)")
    try:
        run = json.loads(held.read_text())
        protocol = dict(run["protocol"])
        points = []
        for mode in ("baseline", "relay"):
            for p in run[mode]["points"]:
                if p.get("shared_with"):
                    continue  # the same trace as another sweep's point: judged once
                seeds = tuple(int(r["trace_seed"]) for r in p["repeats"])
                points.append(HeldOutPoint(mode, p["sweep"], int(p["length"]), float(p["qps"]), seeds, p))
        limits = {m: run[m]["max_qps_at_slo"] for m in ("baseline", "relay")}
    except (ValueError, KeyError, TypeError) as exc:
        raise _fail(held, f"not a held-out serve-bench.json ({type(exc).__name__}: {exc})") from None
    return ValidationSet(d, prof, held, protocol, tuple(points), limits, _step_log(d / STEP_LOG_FILE))


def _step_log(path: Path) -> tuple[dict[str, Any], ...]:
    import gzip

    from grstack.runtime.bench.serve import read_step_log_file

    if not path.exists():
        return ()
    try:
        return tuple(read_step_log_file(path))
    except (OSError, EOFError, gzip.BadGzipFile, ValueError, KeyError, TypeError) as exc:
        raise _fail(path, f"not a step log ({type(exc).__name__}: {exc})") from None


def _p99(x: float | None) -> float:
    return math.inf if x is None else float(x)


def _shed_share(p: Mapping[str, Any]) -> float | None:
    n = p.get("n")
    if not n:
        return None
    return sum(v for k, v in (p.get("errors_by_kind") or {}).items() if k.startswith("shed")) / n


def _admitted_share(p: Mapping[str, Any]) -> float | None:
    d = p.get("trigger_decisions") or {}
    total = sum(d.values())
    if not total or "disabled" in d:
        return None
    return (d.get("admitted", 0) + d.get("live", 0)) / total


def compare(held: HeldOutPoint, predicted: Mapping[str, Any], slo_ms: float, rules: Rules = Rules()) -> dict[str, Any]:
    """One validation entry: the point's P99 against the repeats' spread, and the secondary checks."""
    m = held.measured
    lo, hi = _p99(m.get("p99_ms_min")), _p99(m.get("p99_ms_max"))
    median = _p99(m.get("p99_ms"))
    pred = _p99(predicted.get("p99_ms"))
    # a measured point that failed with a repeat giving up is matched only by a failing prediction
    failed = median > slo_ms and hi == math.inf
    within = (pred > slo_ms and pred >= lo) if failed else lo <= pred <= hi
    checks = {}
    for name, fm, fp, rate in (("hit_rate", m.get("hit_rate"), predicted.get("hit_rate"), True),
                               ("admitted_share", _admitted_share(m), _admitted_share(predicted), True),
                               ("compute_ms_per_visit", m.get("compute_ms_per_visit"),
                                predicted.get("compute_ms_per_visit"), False),
                               ("shed_share", _shed_share(m), _shed_share(predicted), True)):
        checks[name] = {"measured": fm, "predicted": fp, "within": rules.close(fm, fp, rate)}
    return {"mode": held.mode, "point": f"{held.length}@{held.qps:g}", "seeds": list(held.seeds),
            "p99_ms_measured": None if median == math.inf else median,
            "p99_ms_measured_spread": [lo, None if hi == math.inf else hi],
            "p99_ms_predicted": None if pred == math.inf else pred, "within": bool(within),
            "meets_slo_measured": median <= slo_ms, "meets_slo_predicted": pred <= slo_ms, "checks": checks}


def knee_check(mode: str, measured_limit: float | None, grid: list[float], predicted_limit: float | None,
               resolution: float = 0.05) -> dict[str, Any]:
    """The simulated knee against the real one. The real limit is known only to lie in [limit, next grid value)
    (the first failing value); the simulated one, found to ``resolution``, matches when it lies in that bracket
    widened by one step of ``resolution`` at each end. No real limit (the lowest value failed): the simulated
    one must be below the lowest value too."""
    values = sorted(grid)
    if measured_limit is None:
        within = predicted_limit is None or predicted_limit < values[0] * (1 + resolution)
        bracket: list[float | None] = [None, values[0]]
    else:
        nxt = next((v for v in values if v > measured_limit), None)
        bracket = [measured_limit, nxt]
        within = predicted_limit is not None and predicted_limit >= measured_limit / (1 + resolution) and (
            nxt is None or predicted_limit < nxt * (1 + resolution))
    return {"mode": mode, "measured_limit": measured_limit, "measured_bracket": bracket,
            "predicted_limit": predicted_limit, "within": bool(within)}


def summary(entries: list[dict[str, Any]], knees: list[dict[str, Any]]) -> dict[str, Any]:
    misses = [f"{e['mode']} {e['point']}: P99 {e['p99_ms_predicted']} outside {e['p99_ms_measured_spread']}"
              for e in entries if not e["within"]]
    misses += [f"{e['mode']} {e['point']} {k}: {c['predicted']} vs {c['measured']}" for e in entries
               for k, c in e["checks"].items() if c["within"] is False]
    misses += [f"{k['mode']} knee: {k['predicted_limit']} vs {k['measured_bracket']}" for k in knees if not k["within"]]
    return {"entries": len(entries), "p99_within": sum(e["within"] for e in entries),
            "checks_within": sum(c["within"] is True for e in entries for c in e["checks"].values()),
            "checks_judged": sum(c["within"] is not None for e in entries for c in e["checks"].values()),
            "knees_within": sum(k["within"] for k in knees), "knees": len(knees),
            "all_within": not misses, "misses": misses, "rules": asdict(Rules())}

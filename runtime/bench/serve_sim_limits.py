"""Limits to 5 % with intervals: the statistics and searches ``grstack bench serve --simulate`` decides with.

* :func:`p99_interval` — a point's P99 and its bootstrap 95 % interval, resampling each seed's measured ranks
  within that seed (a stratified bootstrap: seeds are independent traces, ranks within one are not exchangeable
  across them). Failed ranks are ``inf``: above any SLO.
* :func:`find_limit` — the largest value whose point meets the SLO with every smaller probed value meeting it too
  (the real benchmark's rule), by doubling or halving from a start to a bracket and geometric bisection until the
  bracket is within ``1 + resolution``. Its interval: from the largest probed value whose point *certainly*
  passes (upper P99 bound within the SLO, and every smaller probed value too) to the smallest probed value whose
  point certainly fails (lower bound above the SLO); a value between them could be the limit under resampling.
* :func:`versus` — a limit ratio and its interval from the two limits' intervals (lower over upper, upper over
  lower: conservative, no independence assumed beyond each limit's own).
* :func:`plan_capacity` — the fewest replicas meeting the SLO, per device memory, for a monotone predicate.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Point = Mapping[str, Any]


def p99_interval(groups: Sequence[Sequence[float]], q: float = 99.0, level: float = 0.95, resamples: int = 2000,
                 rng: np.random.Generator | None = None) -> tuple[float, float, float]:
    """(P99 of all ranks pooled, lower, upper) — numpy's ``higher`` percentile, as the real benchmark takes it."""
    rng = rng if rng is not None else np.random.default_rng(0)
    arrays = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if not arrays:
        return math.nan, math.nan, math.nan
    pooled = np.concatenate(arrays)
    point = float(np.percentile(pooled, q, method="higher"))
    draws = np.concatenate([a[rng.integers(0, len(a), (resamples, len(a)))] for a in arrays], axis=1)
    stats = np.percentile(draws, q, axis=1, method="higher")
    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha], method="higher")
    return point, float(lo), float(hi)


@dataclass
class LimitResult:
    limit: float | None  # the largest value passing with every smaller probed value passing; None: none does
    bracket: tuple[float | None, float | None]  # (last passing, first failing) probed values
    ci95: tuple[float | None, float | None]  # (certain-pass value, certain-fail value); None: not reached
    points: list[dict[str, Any]] = field(default_factory=list)
    lower_bound_only: bool = False  # the ceiling itself passed: the limit is at least that

    def to_json(self) -> dict[str, Any]:
        return {"limit": self.limit, "bracket": list(self.bracket), "ci95": list(self.ci95),
                "lower_bound_only": self.lower_bound_only, "points": len(self.points)}


def limit_of(points: Sequence[Point], key: str, slo_ms: float) -> LimitResult:
    """The limit and its interval from probed points (each with ``key``, ``p99_ms``, ``p99_ms_lo``, ``p99_ms_hi``)."""
    pts = sorted(points, key=lambda p: p[key])
    limit = None
    first_fail = None
    for p in pts:
        if p["p99_ms"] <= slo_ms:
            limit = p[key]
        else:
            first_fail = p[key]
            break
    certain_pass = None
    for p in pts:
        if p["p99_ms_hi"] <= slo_ms:
            certain_pass = p[key]
        else:
            break
    certain_fail = next((p[key] for p in pts if p["p99_ms_lo"] > slo_ms), None)
    return LimitResult(limit, (limit, first_fail), (certain_pass, certain_fail), [dict(p) for p in pts])


async def find_limit(measure: Callable[[float], Awaitable[dict[str, Any]]], start: float, *, slo_ms: float,
                     key: str, resolution: float = 0.05, floor: float | None = None, ceiling: float | None = None,
                     integer: bool = False, max_points: int = 24,
                     settle: Callable[[float], Awaitable[dict[str, Any]]] | None = None,
                     max_settle: int = 3) -> LimitResult:
    """Bisection on a monotone knee: ``measure(v)`` gives the point at ``v`` (with ``p99_ms`` and its interval).

    ``measure`` may stop sending once a point is certain to miss the SLO (``"whole": False``): its P99's lower
    bound then counts the unsent ranks as 0 ms and can rarely show the point certainly failing, which leaves
    the limit's interval open above. ``settle(v)`` measures ``v`` whole; the failing probed values above the
    limit are re-measured with it, lowest first, until one certainly fails (at most ``max_settle``)."""
    seen: dict[float, dict[str, Any]] = {}

    def value(v: float) -> float:
        v = max(v, floor) if floor is not None else v
        v = min(v, ceiling) if ceiling is not None else v
        return float(max(1, round(v))) if integer else v

    async def probe(v: float) -> bool:
        v = value(v)
        if v not in seen:
            seen[v] = await measure(v)
        return bool(seen[v]["p99_ms"] <= slo_ms)

    lo: float | None = None
    hi: float | None = None
    v = value(start)
    if await probe(v):
        lo = v
        while hi is None and len(seen) < max_points:
            nxt = value(lo * 2)
            if nxt == lo:  # the ceiling passed
                break
            if await probe(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi = v
        while lo is None and len(seen) < max_points:
            nxt = value(hi / 2)
            if nxt == hi:  # the floor failed
                break
            if await probe(nxt):
                lo = nxt
            else:
                hi = nxt
    while lo is not None and hi is not None and hi / lo > 1 + resolution and len(seen) < max_points:
        mid = value(math.sqrt(lo * hi))
        if mid in (lo, hi):
            break
        if await probe(mid):
            lo = mid
        else:
            hi = mid
    if settle is not None:
        settled = 0
        for v in sorted(seen):
            p = seen[v]
            if p["p99_ms"] <= slo_ms:
                continue
            if p["p99_ms_lo"] > slo_ms or settled >= max_settle:
                break  # certainly failing already, or no more re-measures
            if p.get("whole", True):
                continue  # every rank was sent: its interval is what it is
            seen[v] = await settle(v)
            settled += 1
            if seen[v]["p99_ms_lo"] > slo_ms:
                break
    res = limit_of(list(seen.values()), key, slo_ms)
    res.lower_bound_only = lo is not None and hi is None
    return res


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def versus(a: LimitResult, b: LimitResult) -> dict[str, Any]:
    """``a``'s limit over ``b``'s, with the interval lower(a)/upper(b) .. upper(a)/lower(b) (None where an end is
    not known: an upper end never reached is unbounded)."""
    (a_lo, a_hi), (b_lo, b_hi) = a.ci95, b.ci95
    return {"ratio": _ratio(a.limit, b.limit), "ci95": [_ratio(a_lo, b_hi) if a_lo is not None else None,
                                                         _ratio(a_hi, b_lo) if a_hi is not None else None]}


def versus_modes(mode: Mapping[str, LimitResult], against: Mapping[str, LimitResult]) -> dict[str, Any]:
    """The fields of every comparison in the JSON: both ratios and their intervals."""
    length, qps = versus(mode["length"], against["length"]), versus(mode["qps"], against["qps"])
    return {"max_len_ratio": length["ratio"], "slo_qps_ratio": qps["ratio"],
            "ci95": {"max_len_ratio": length["ci95"], "slo_qps_ratio": qps["ci95"]}}


def separated(below: tuple[float | None, float | None], above: tuple[float | None, float | None]) -> bool:
    """Whether the interval ``below`` lies wholly under ``above`` (an unknown end counts as overlapping)."""
    top, bottom = below[1], above[0]
    return top is not None and bottom is not None and top <= bottom


async def plan_capacity(meets: Callable[[int, float], Awaitable[bool]], device_options: Sequence[float],
                        max_replicas: int = 256) -> list[dict[str, Any]]:
    """For each device memory, the fewest replicas ``r`` with ``meets(r, device)`` (monotone in ``r``): doubling to
    a bracket, then binary search; ``replicas`` None when even ``max_replicas`` fails."""
    out = []
    for device in device_options:
        replicas, probes = await _fewest(lambda r, device=device: meets(r, device), max_replicas)
        out.append({"device_bytes": device, "replicas": replicas, "probes": probes})
    return out


async def _fewest(ok: Callable[[int], Awaitable[bool]], top: int) -> tuple[int | None, int]:
    """The smallest ``r`` in 1..``top`` with ``ok(r)`` (monotone), and how many values were tried."""
    known: dict[int, bool] = {}

    async def test(r: int) -> bool:
        if r not in known:
            known[r] = await ok(r)
        return known[r]

    lo, hi = 0, 1  # 0 replicas serve nothing
    while hi < top and not await test(hi):
        lo, hi = hi, min(hi * 2, top)
    if not await test(hi):
        return None, len(known)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await test(mid):
            hi = mid
        else:
            lo = mid
    return hi, len(known)

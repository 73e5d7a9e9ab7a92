"""``grstack bench serve --calibrate``: the cost profile of the benchmark's rankers, measured in service.

The real benchmark's rankers and router (the relay mode's; the full form adds the baseline's, whose misses
are all full inference) serve its trace at a few load points, lengths and rates spread so the step sizes
vary enough to separate the cost terms. After each point every ranker's step and request logs
(``GET /v1/steps``) are read and the load generator's answers give the hops (``X-Grstack-*-Ms``). The profile
(runtime/serve/cost_profile.py) is fitted to all of it, so its residuals hold the load points' queueing
interference (a busy core, a collection), which is what a simulator must reproduce.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from grstack.runtime.bench.serve import (
    MAX_SUFFIX,
    Settings,
    measure_once,
    mode_runs,
    read_step_log,
    settings_from,
    write_model,
)
from grstack.runtime.serve import CostProfile, fit_hops, fit_requests, fit_steps

QUICK: dict[str, Any] = {"users": 400, "points": [(256, 20.0), (512, 40.0), (1024, 15.0)], "measured": 250,
                         "warmup": 50, "modes": ("relay",)}
FULL: dict[str, Any] = {"users": 2000, "points": [(256, 20.0), (512, 20.0), (512, 40.0), (512, 80.0), (1024, 20.0),
                                                  (1024, 40.0), (2048, 20.0)],
                        "measured": 1000, "warmup": 250, "modes": ("relay", "baseline")}


def _log(msg: str) -> None:
    print(f"[bench serve --calibrate] {msg}", file=sys.stderr, flush=True)


def parse_points(text: str) -> list[tuple[int, float]]:
    from grstack.runtime.errors import UserError

    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            length, qps = part.split(":")
            pt = (int(length), float(qps))
        except ValueError:
            raise UserError(f"--calibrate-points: expected length:qps pairs, got {part!r}") from None
        if pt[0] < 1 or pt[1] <= 0:
            raise UserError(f"--calibrate-points: length and qps must be positive, got {part!r}")
        out.append(pt)
    if not out:
        raise UserError("--calibrate-points: no points given")
    return out


def hops_of(results: list[Any]) -> dict[str, list[float]]:
    """Seconds of each hop of the answered ranks, from the load generator's latency and the headers the router
    and the ranker set: ``harness`` (send to the router and back, the load generator's own lateness included),
    ``router`` (its handler outside the answering attempt), ``link`` (router to ranker and back)."""
    out: dict[str, list[float]] = {"harness": [], "router": [], "link": []}
    for r in results:
        h = r.headers
        if r.status != 200 or r.request.path != "/v1/rank" or not {"X-Grstack-Router-Ms", "X-Grstack-Forward-Ms",
                                                                     "X-Grstack-Ranker-Ms"} <= set(h):
            continue
        router, forward, ranker = (float(h[k]) / 1e3 for k in ("X-Grstack-Router-Ms", "X-Grstack-Forward-Ms",
                                                               "X-Grstack-Ranker-Ms"))
        out["harness"].append(max(0.0, r.latency_ms / 1e3 - router))
        out["router"].append(max(0.0, router - forward))
        out["link"].append(max(0.0, forward - ranker))
    return out


async def read_startup_profile(session: Any, url: str) -> dict[str, Any]:
    """A ranker's start-up latency profile (``GET /v1/profile``): what the router's trigger reads."""
    async with session.get(url + "/v1/profile") as resp:
        resp.raise_for_status()
        return dict(await resp.json())


def wall_over_cpu(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per step kind: steps, their summed seconds and compute-thread CPU seconds, and the ratio of the two (above
    1 by the share of each step the ranker's core gave to its other threads, the event loop's request handling
    first: what a profile of wall seconds carries from the load it was measured at)."""
    out: dict[str, dict[str, float]] = {}
    for kind in sorted({s["kind"] for s in steps}):
        timed = [s for s in steps if s["kind"] == kind and s.get("cpu_seconds") is not None]
        wall, cpu = sum(s["seconds"] for s in timed), sum(s["cpu_seconds"] for s in timed)
        if timed and cpu > 0:
            out[kind] = {"steps": len(timed), "wall_s": wall, "cpu_s": cpu, "ratio": wall / cpu}
    return out


def compute_over_steps(point: dict[str, Any], results: list[Any], steps: list[dict[str, Any]]) -> float | None:
    """The rankers' accounted compute over the point (``compute_ms_per_visit`` times the visits: each step from
    its hand-off to the compute thread until the event loop takes its result back) over the summed seconds of the
    steps they logged (the math alone): above 1 by the hops, which grow as the event loop gets busier."""
    per_visit = point.get("compute_ms_per_visit")
    visits = sum(r.request.path == "/v1/rank" for r in results)
    step_s = sum(s["seconds"] for s in steps)
    if per_visit is None or not visits or step_s <= 0:
        return None
    return float(per_visit * visits / 1e3 / step_s)


def host_info(s: Settings) -> dict[str, Any]:
    """What the profile was measured on."""
    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"hostname": platform.node(), "platform": platform.platform(), "cpu": cpu or platform.processor(),
            "cores": os.cpu_count(), "device": "cpu", "torch": torch.__version__, "torch_threads": 1,
            "rankers": s.rankers, "ranker_cpus": sorted(s.ranker_cpus) if s.ranker_cpus else None,
            "harness_cpus": sorted(s.harness_cpus) if s.harness_cpus else None}


async def calibrate(s: Settings, points: list[tuple[int, float]],
                    modes: tuple[str, ...]) -> tuple[CostProfile, dict[str, Any]]:
    """The fitted profile and the records it was fitted to (steps, requests, hops), for refits and checks."""
    t0 = time.monotonic()
    checkpoint, max_len, _ = write_model(s)
    steps: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    hops: dict[str, list[float]] = {}
    measured: list[dict[str, Any]] = []
    startup: list[dict[str, Any]] = []
    async with mode_runs(modes, checkpoint, s, [], t0) as runs:
        since = {url: (0, 0) for m in runs.values() for url in m.ranker_urls}
        for mode, m in runs.items():
            for url in m.ranker_urls:
                startup.append({"mode": mode, **await read_startup_profile(m.session, url)})
        for url in since:  # start-up (warm-up, profile) is not service: skip what is logged so far
            _, since[url] = await read_step_log(next(iter(runs.values())).session, url, (0, 0))
        for length, qps in points:
            for mode, m in runs.items():
                results: list[Any] = []
                point = await measure_once(m, "calibrate", length, qps, 0, results, whole=True)
                point_steps: list[dict[str, Any]] = []
                for url in m.ranker_urls:
                    got, since[url] = await read_step_log(m.session, url, since[url])
                    point_steps += got["steps"]
                    requests += got["requests"]
                steps += point_steps
                for k, v in hops_of(results).items():
                    hops.setdefault(k, []).extend(v)
                measured.append({"mode": mode, "length": length, "qps": qps, "p99_ms": point["p99_ms"],
                                 "p50_ms": point["p50_ms"], "hit_rate": point["hit_rate"], "n": point["n"],
                                 "errors_by_kind": point["errors_by_kind"],
                                 "steps_wall_over_cpu": wall_over_cpu(point_steps),
                                 "compute_over_steps": compute_over_steps(point, results, point_steps)})
                _log(f"calibrate {mode:8s} length={length:5d} qps={qps:6.1f}: p50={point['p50_ms']:.1f} ms "
                     f"p99={point['p99_ms']:.1f} ms, {len(steps)} steps and {len(requests)} requests logged so far")
    if not steps:
        from grstack.runtime.errors import UserError

        raise UserError("no compute step was logged: nothing to fit")
    model = {"name": "benchmark HSTU (untrained; d=64, 2 blocks, 2 heads, fp32)", "max_len": max_len,
             "max_suffix": MAX_SUFFIX, "kv_dtype": "fp32"}
    host = {**host_info(s), "points": measured, "modes": list(modes), "seconds": round(time.monotonic() - t0, 1)}
    profile = CostProfile(source="calibrated", host=host, model=model, steps=fit_steps(steps),
                          requests=fit_requests(requests), hops=fit_hops(hops),
                          notes=f"grstack bench serve --calibrate: {len(steps)} steps, {len(requests)} requests, "
                                f"{len(hops.get('harness', []))} answered ranks at {len(points)} load points",
                          startup=startup)
    return profile, {"steps": steps, "requests": requests, "hops": hops}


def run_calibrate(args: argparse.Namespace) -> int:
    preset = QUICK if args.quick else FULL
    points = parse_points(args.calibrate_points) if args.calibrate_points else list(preset["points"])
    base = settings_from(args)
    lengths = sorted({length for length, _ in points})
    s = replace(base, users=args.users or preset["users"],
                measured=preset["measured"] if args.measured is None else args.measured,
                warmup=preset["warmup"] if args.warmup is None else args.warmup,
                lengths=lengths, qps_length=lengths[0], length_qps=points[0][1], qps=[q for _, q in points],
                repeats=1)
    out = Path(args.calibrate) if args.calibrate else s.out / "cost-profile.json"
    _log(f"calibrating at {len(points)} load points ({', '.join(f'{n}:{q:g}' for n, q in points)}), "
         f"{s.warmup} + {s.measured} visits each, modes {', '.join(preset['modes'])}")
    profile, records = asyncio.run(calibrate(s, points, tuple(preset["modes"])))
    profile.save(out)
    log = out.with_name(f"{out.stem}-log.json")
    log.write_text(json.dumps(records))
    _log(f"cost profile written to {out}, the records it was fitted to to {log}")
    print(json.dumps(json.loads(out.read_text())))
    return 0

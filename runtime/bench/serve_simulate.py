"""``grstack bench serve --simulate``: the relay-serving benchmark on virtual time, at the scale it is for.

Every point is a run of the real control plane (runtime/bench/serve_sim.py) on the real benchmark's trace, with
the tensor math and the host work replaced by a cost profile. Three parts, each in the JSON:

* ``validation`` — first: the simulator, calibrated on pinned real runs (``--calibrate``), predicts held-out real
  runs (other seeds and rates) that were measured and stored before; each entry says whether the prediction is
  within what the real runs showed (runtime/bench/serve_sim_validate.py). Nothing is fitted to the points judged.
* ``scale`` and the limits — the paper-scale protocol (docs/serve-simulator.md): a 0.2B
  HSTU in bf16 on H200s, ``--replicas`` per deployment on ``--servers`` servers sharing a DRAM tier each, the
  protocol trace; every mode's length and QPS limits found by bisection to 5 % with bootstrap 95 % intervals
  over the seeds' ranks (runtime/bench/serve_sim_limits.py), and the ratios with their intervals.
* ``plan`` (``--plan``) — the fewest replicas meeting the SLO at ``--qps`` for each device memory, relay and
  full inference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from grstack.runtime.bench import serve as real
from grstack.runtime.bench import serve_sim_limits as search
from grstack.runtime.bench import serve_sim_validate as validate
from grstack.runtime.bench.serve_sim import Deployment, SimulatedDeployment, measure_point
from grstack.runtime.bench.serve_trace import TraceConfig
from grstack.runtime.serve import CostProfile

GB = 1 << 30
MB = 1 << 20
# The stored real runs the validation reads, and whose host costs the paper profile takes (docs/serve-simulator.md,
# "Validation first"): the profile calibrated on
# pinned real runs and the held-out real benchmark it predicts.
VALIDATION_DIR = Path(__file__).resolve().parent / "serve_validation"  # package data: ships in the wheel
RESOLUTION = 0.05  # limits by bisection to this relative step
MIN_LENGTH = 256  # the shortest median long-term length a length sweep probes
LENGTH_QPS_PER_REPLICA = 50.0  # the length sweep's rate, per replica (docs/serve-simulator.md)

# The paper-scale protocol (docs/serve-simulator.md), fixed before it was run.
PAPER_QUICK: dict[str, Any] = {"replicas": 2, "servers": 1, "users": 20_000, "seeds": 2, "measured": 1000,
                               "warmup": 250, "length_qps": None, "qps_length": 4096, "length_start": 4096}
PAPER_FULL: dict[str, Any] = {"replicas": 8, "servers": 1, "users": 60_000, "seeds": 3, "measured": 10_000,
                              "warmup": 2000, "length_qps": None, "qps_length": 4096, "length_start": 4096}
PAPER_SLO_MS = 100.0
PAPER_DRAM_GB_PER_SERVER = 1536.0  # of a DGX H200's 2 TB system memory (docs/serve-simulator.md)
PAPER_DEVICE_USABLE = 0.9  # of the H200's 141 GB, beside the weights (cost_paper_scale.PaperScale)


def _log(msg: str) -> None:
    print(f"[bench serve --simulate] {msg}", file=sys.stderr, flush=True)


@dataclass
class SimSettings(real.Settings):
    """The real benchmark's settings with the simulated deployment's cache sizes in the trace's pressure sizing."""

    kv_bytes_per_token: int = real.KV_BYTES_PER_TOKEN
    device_cache_total_bytes: int = real.RANKERS * (real.DEVICE_CACHE_MB << 20)
    seeds: int = 1

    def trace_config(self, length: int, qps: float, repeat: int) -> TraceConfig:
        cfg = super().trace_config(length, qps, repeat)
        if cfg.kv_bytes_per_token and cfg.device_cache_bytes:
            cfg = replace(cfg, kv_bytes_per_token=self.kv_bytes_per_token,
                          device_cache_bytes=self.device_cache_total_bytes)
        return cfg


class Simulator:
    """Points of one deployment and profile: each seed a fresh deployment of the mode serving that seed's trace."""

    def __init__(self, s: SimSettings, dep: Deployment, profile: CostProfile, model: Any, tasks: list[str],
                 max_len: int, tails: bool = True, whole: bool = False) -> None:
        self.s, self.dep, self.profile, self.model, self.tasks, self.max_len = s, dep, profile, model, tasks, max_len
        self.tails = tails
        self.points = 0
        # send every rank even once a seed's P99 is certain to miss the SLO (the validation compares whole
        # points); the searches stop sending, as the real benchmark does, and keep an optimistic lower bound
        self.whole = whole

    async def run(self, mode: str, sweep: str, length: int, qps: float, seeds: list[int],
                  whole: bool | None = None, profile: CostProfile | None = None) -> dict[str, Any]:
        """One point; ``profile``: these costs instead of the simulator's (the host's measured speed)."""
        s = self.s
        whole = self.whole if whole is None else whole
        runs = []
        for k, seed in enumerate(seeds):
            d = SimulatedDeployment(mode, self.dep, profile or self.profile, self.model, self.tasks, s.slo_ms,
                                    self.max_len,
                                    seed=seed * 1_000_003 + k, tails=self.tails)
            await d.start()
            try:
                trace = s.trace(length, qps, seed - s.seed)
                runs.append(await measure_point(d, trace, f"{mode}-{sweep}-L{length}-q{qps:g}-s{seed}", s.slo_ms,
                                                whole=whole))
            finally:
                await d.stop()
        self.points += 1
        groups = [r.pop("latencies_ms") for r in runs]
        optimistic = [r.pop("latencies_ms_optimistic") for r in runs]
        p99, _, hi = search.p99_interval(groups)
        lo = search.p99_interval(optimistic)[1]  # a seed that gave up: its unsent ranks could have been fast
        point = {"sweep": sweep, "length": length, "qps": qps, "seeds": seeds, **real.combine(runs, s.slo_ms),
                 "p99_ms_pooled": p99, "p99_ms_lo": lo, "p99_ms_hi": hi, "whole": whole}
        point["p99_ms_median_of_seeds"] = point["p99_ms"]
        point["p99_ms"] = p99
        point["meets_slo"] = bool(p99 <= s.slo_ms)
        for r in point["repeats"]:
            r.pop("trace", None)
        hr = "-" if point["hit_rate"] is None else f"{point['hit_rate']:.2f}"
        _log(f"{mode:12s} {sweep:6s} length={length:6d} qps={qps:8.1f}: p99={p99:8.1f} ms [{lo:.1f}, {hi:.1f}] "
             f"hit_rate={hr} errors={point['errors_by_kind'] or 0}")
        return point


async def length_limit(sim: Simulator, mode: str, qps: float, start: int, seeds: list[int]) -> Any:
    """A mode's median-length limit at ``qps``, by bisection to 5 %."""
    return await search.find_limit(lambda v: sim.run(mode, "length", int(v), qps, seeds), start,
                                   slo_ms=sim.s.slo_ms, key="length", resolution=RESOLUTION, floor=MIN_LENGTH,
                                   ceiling=real.MAX_LENGTH, integer=True,
                                   settle=lambda v: sim.run(mode, "length", int(v), qps, seeds, whole=True))


async def qps_limit(sim: Simulator, mode: str, length: int, start: float, seeds: list[int]) -> Any:
    """A mode's QPS limit at median length ``length``, by bisection to 5 %."""
    return await search.find_limit(lambda v: sim.run(mode, "qps", length, float(v), seeds), start,
                                   slo_ms=sim.s.slo_ms, key="qps", resolution=RESOLUTION, floor=start / 256,
                                   ceiling=start * 64,
                                   settle=lambda v: sim.run(mode, "qps", length, float(v), seeds, whole=True))


def qps_sweep_length(baseline_len: int | None) -> int:
    """The QPS sweep's median length: the largest power of two at which full inference met the SLO in the length
    sweep (so that both sides of ``slo_qps_ratio`` exist), the smallest swept length when it met none."""
    if baseline_len is None or baseline_len < MIN_LENGTH:
        return MIN_LENGTH
    return 1 << (int(baseline_len).bit_length() - 1)


def _mode_result(by_len: Any, by_qps: Any) -> dict[str, Any]:
    return {"points": [*by_len.points, *by_qps.points], "max_len_at_slo": by_len.limit,
            "max_qps_at_slo": by_qps.limit, "limits": {"length": by_len, "qps": by_qps},
            "ci95": {"max_len_at_slo": list(by_len.ci95), "max_qps_at_slo": list(by_qps.ci95)},
            "searches": {"length": by_len.to_json(), "qps": by_qps.to_json()}}


def comparison(mode: dict[str, Any], against: dict[str, Any]) -> dict[str, Any]:
    return search.versus_modes(mode["limits"], against["limits"])


def _strip(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k != "limits"}


def paper_profile(host_costs: Path | None) -> CostProfile:
    from grstack.runtime.serve import paper_scale_profile, with_host_costs

    profile = paper_scale_profile()
    if host_costs is not None and host_costs.exists():
        profile = with_host_costs(profile, CostProfile.load(host_costs))
    return profile


def load_profile(spec: str) -> CostProfile:
    from grstack.runtime.errors import UserError

    if spec == "paper":
        return paper_profile(VALIDATION_DIR / "cost-profile.json")
    try:
        return CostProfile.load(spec)
    except FileNotFoundError:
        raise UserError(f"--model {spec}: no such file (paper, or a cost profile from --calibrate)") from None
    except (ValueError, KeyError) as exc:
        raise UserError(f"--model {spec}: not a cost profile ({exc})") from None


def paper_deployment(profile: CostProfile, replicas: int, servers: int, device_gb: float | None,
                     dram_gb: float | None, shared_cores: bool = False) -> Deployment:
    """The paper-scale deployment: per replica one accelerator (its device memory beside the weights) and a host
    core for its requests, per server the DRAM tier."""
    m = profile.model
    if device_gb is not None:
        device = device_gb * GB
    else:
        device = m["device_memory_bytes"] * m.get("memory_utilization", PAPER_DEVICE_USABLE) \
            - m["dense_params"] * m["dtype_bytes"]
    dram = (dram_gb if dram_gb is not None else PAPER_DRAM_GB_PER_SERVER) * GB
    return Deployment(replicas=replicas, servers=servers, cores_per_replica=1, device_cache_mb=device / MB,
                      dram_mb_per_server=dram / MB, dram_ttl_s=real.DRAM_TTL_S, shared_cores=shared_cores,
                      accelerator=True)


def _model(s: SimSettings) -> tuple[Any, list[str], int]:
    from grstack.runtime.serve import load_serving_model

    checkpoint, max_len, _ = real.write_model(s)
    model, tasks, _ = load_serving_model(checkpoint)
    return model, tasks, max_len


def _paper_settings(args: argparse.Namespace, preset: dict[str, Any], profile: CostProfile,
                    dep: Deployment) -> SimSettings:
    slo = args.slo_ms if args.slo_ms is not None else PAPER_SLO_MS
    length = args.qps_length or preset["qps_length"]
    return SimSettings(users=args.users or preset["users"], lengths=[length], length_qps=1.0, qps=[1.0],
                       qps_length=length, repeats=1, slo_ms=slo, gap_ms=args.cascade_gap_ms,
                       measured=args.measured or preset["measured"], warmup=args.warmup or preset["warmup"],
                       seed=args.seed, out=Path(args.out) / "simulate", qps_floor=1.0,
                       min_user_gap_s=args.min_user_gap_s, rankers=dep.replicas, trace_kind=args.trace,
                       kv_bytes_per_token=int(profile.model.get("kv_bytes_per_token", real.KV_BYTES_PER_TOKEN)),
                       device_cache_total_bytes=int(dep.replicas * dep.device_cache_mb * MB),
                       seeds=args.seeds or preset["seeds"])


def capacity_qps(profile: CostProfile, dep: Deployment, length: int, relay: bool) -> float:
    """A start for the QPS bisection: what the replicas could serve at all at ``length`` (full inference of the
    prefix per visit, or one cached rank), from the profile's prediction."""
    from grstack.runtime.serve import attention_pairs

    n = length + real.MAX_SUFFIX + real.CANDIDATES
    if relay:
        s = profile.step_s("rank_cached", 1, real.MAX_SUFFIX + real.CANDIDATES, length,
                           attention_pairs([real.MAX_SUFFIX + real.CANDIDATES], [length]))
    else:
        s = profile.step_s("rank_full", 1, n, 0, attention_pairs([n], [0]))
    return max(1.0, 0.5 * dep.replicas * dep.cores_per_replica / max(s, 1e-6))


@dataclass(frozen=True)
class ScaleSetup:
    """What every search of one paper-scale run shares; a worker process rebuilds its simulator from it."""

    s: SimSettings
    dep: Deployment
    model_spec: str
    checkpoint: str
    max_len: int


_WORKER: dict[str, Any] = {}


def _worker_init(setup: ScaleSetup) -> None:
    """A search worker: the profile and the model loaded once, one simulator for every search it runs."""
    from grstack.runtime.serve import load_serving_model

    model, tasks, _ = load_serving_model(Path(setup.checkpoint))
    _WORKER["sim"] = Simulator(setup.s, setup.dep, load_profile(setup.model_spec), model, tasks, setup.max_len)


def _search(job: tuple[str, str, float, float, list[int]]) -> tuple[Any, int]:
    """One mode's limit (``kind`` length at rate ``at``, or qps at length ``at``) from ``start``: the limit and
    the points it simulated."""
    from grstack.runtime.serve import run_virtual

    kind, mode, at, start, seeds = job
    sim: Simulator = _WORKER["sim"]
    before = sim.points
    if kind == "length":
        found = run_virtual(lambda: length_limit(sim, mode, at, int(start), seeds))
    else:
        found = run_virtual(lambda: qps_limit(sim, mode, int(at), start, seeds))
    return found, sim.points - before


class SearchPool:
    """The modes' searches in ``jobs`` worker processes (each search is one mode's, independent of the others
    and deterministic in its seeds, so the results do not depend on how they are spread); ``jobs`` 1 runs
    them in this process."""

    def __init__(self, setup: ScaleSetup, jobs: int) -> None:
        self.setup, self.jobs, self.points = setup, jobs, 0
        self._pool: Any = None

    def __enter__(self) -> SearchPool:
        if self.jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_worker_init, initargs=(self.setup,))
        else:
            _worker_init(self.setup)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def submit(self, jobs: list[tuple[str, str, float, float, list[int]]]) -> Any:
        """Starts ``jobs``; the returned callable waits for them and gives their limits in order."""
        if self._pool is None:
            done = [_search(j) for j in jobs]
            futures = None
        else:
            futures = [self._pool.submit(_search, j) for j in jobs]

        def results() -> list[Any]:
            got = done if futures is None else [f.result() for f in futures]
            self.points += sum(n for _, n in got)
            return [found for found, _ in got]
        return results


def default_jobs() -> int:
    import os

    return max(1, min(len(real.MODES), os.cpu_count() or 1))


def scale_part(args: argparse.Namespace, quick: bool, before_wait: Any = None) -> dict[str, Any]:
    """Every mode's length and QPS limits at the paper-scale protocol, the searches spread over ``--jobs``
    worker processes; ``before_wait`` (the validation) runs here while the first searches run there."""
    preset = PAPER_QUICK if quick else PAPER_FULL
    profile = load_profile(args.model)
    dep = paper_deployment(profile, args.replicas or preset["replicas"], args.servers or preset["servers"],
                           args.device_gb, args.dram_gb, shared_cores=shared_cores(args))
    s = _paper_settings(args, preset, profile, dep)
    s.lengths = [s.qps_length, 4 * s.qps_length]
    checkpoint, max_len, _ = real.write_model(s)
    seeds = [s.seed + k for k in range(s.seeds)]
    length_qps = args.length_qps or LENGTH_QPS_PER_REPLICA * dep.replicas
    jobs = args.jobs or default_jobs()
    _log(f"paper scale: {dep.replicas} replicas on {dep.servers} server(s), {dep.device_cache_mb / 1024:.1f} GiB "
         f"device tier each, {dep.dram_mb_per_server / 1024:.0f} GiB DRAM per server; SLO {s.slo_ms:g} ms; "
         f"{s.seeds} seeds x {s.measured} measured ranks per point; length sweep at {length_qps:g} QPS; "
         f"{jobs} worker process(es)")
    out: dict[str, Any] = {}
    with SearchPool(ScaleSetup(s, dep, args.model, str(checkpoint), max_len), jobs) as pool:
        lengths = pool.submit([("length", m, length_qps, preset["length_start"], seeds) for m in real.MODES])
        if before_wait is not None:
            out.update(before_wait())
        by_len = dict(zip(real.MODES, lengths(), strict=True))
        qps_length = args.qps_length or qps_sweep_length(by_len["baseline"].limit)
        _log(f"QPS sweep at median length {qps_length} (full inference's length limit: {by_len['baseline'].limit})")
        rates = pool.submit([("qps", m, qps_length, capacity_qps(profile, dep, qps_length, relay=m != "baseline") / 2,
                              seeds) for m in real.MODES])
        by_qps = dict(zip(real.MODES, rates(), strict=True))
    modes = {m: _mode_result(by_len[m], by_qps[m]) for m in real.MODES}
    out.update({
        "scale": {"profile": {"source": profile.source, "model": profile.model, "notes": profile.notes},
                  "deployment": asdict(dep), "slo_ms": s.slo_ms, "seeds": seeds, "users": s.users,
                  "measured": s.measured, "warmup": s.warmup, "trace": s.trace_kind,
                  "follow_through": real.FOLLOW_THROUGH, "cache_pressure_target": real.CACHE_PRESSURE,
                  "length_qps": length_qps, "qps_length": qps_length, "resolution": RESOLUTION,
                  "points_simulated": pool.points, "jobs": jobs},
        "relay_vs_full": comparison(modes["relay"], modes["baseline"]),
        "relay_vs_prefix_cache": comparison(modes["relay"], modes["prefix_cache"]),
        "ablations": {a: {**comparison(modes[a], modes["baseline"]),
                          "below_relay": _below(modes[a], modes["relay"])} for a in real.ABLATIONS},
        "modes": {m: _strip(v) for m, v in modes.items()}})
    return out


def _below(ablation: dict[str, Any], relay: dict[str, Any]) -> dict[str, Any]:
    """Whether an ablation's limits are below relay's with intervals that do not overlap (the issue's test)."""
    out = {}
    for key in ("max_len_at_slo", "max_qps_at_slo"):
        a, r = ablation["ci95"][key], relay["ci95"][key]
        out[key] = {"ablation": ablation[key], "relay": relay[key], "ablation_ci95": a, "relay_ci95": r,
                    "separated": search.separated(tuple(a), tuple(r)) and (ablation[key] or 0) < (relay[key] or 0)}
    return out


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if hasattr(x, "__dataclass_fields__"):
        return _json_safe(asdict(x))
    return x


async def validation_part(directory: Path, seeds_only: bool = False,
                          out: Path = Path("runs/bench-serve/simulate/validation"),
                          speed: str = "neighbours", shared_cores: bool = True) -> dict[str, Any]:
    """The held-out real points, simulated on the calibrated profile at the real runs' deployment and traces, and
    each mode's QPS knee found by bisection on the same traces, judged by the fixed rules. ``speed``: when the
    held-out run's step log is stored, scale each point's costs to the host's speed during it, measured on the
    repeats nearest in time to the point (``neighbours``) or on all its other points (``others``); for the knees
    on the whole run; ``calibration``: the calibration's speed. ``own`` (a diagnostic, not the protocol): each
    point at the speed of its own steps, its compute per visit not judged. ``shared_cores``: processor-shared
    cores (the default, as ``--cores``'s), else first come first served."""
    vs = validate.load_validation(directory)
    profile = CostProfile.load(vs.profile_file)
    pr = vs.protocol
    rankers = int(pr["rankers"])
    # each real ranker had its own DRAM tier and one core (pinned): one server per replica here
    dep = Deployment(replicas=rankers, servers=rankers, cores_per_replica=1,
                     device_cache_mb=float(pr["device_cache_mb"]), dram_mb_per_server=float(pr["dram_cache_mb"]),
                     dram_ttl_s=float(pr["dram_ttl_s"]), shared_cores=shared_cores)
    seed0 = min(sd for p in vs.points for sd in p.seeds)
    s = SimSettings(users=int(pr["users"]), lengths=list(pr["lengths"]), length_qps=float(pr["length_qps"]),
                    qps=list(pr["qps"]), qps_length=int(pr["qps_length"]), repeats=int(pr["repeats"]),
                    slo_ms=float(pr["slo_ms"]), gap_ms=float(pr["cascade_gap_ms"]),
                    measured=int(pr["measured_requests_min"]), warmup=int(pr["warmup_visits"]), seed=seed0,
                    out=out, qps_floor=float(pr["qps_floor"]),
                    rankers=rankers, trace_kind=str(pr["trace"]),
                    kv_bytes_per_token=int(pr["kv_bytes_per_token"]),
                    device_cache_total_bytes=int(rankers * float(pr["device_cache_mb"]) * MB))
    model, tasks, max_len = _model(s)
    sim = Simulator(s, dep, profile, model, tasks, max_len, whole=True)
    def at_speed(speed: dict[str, Any] | None) -> CostProfile:
        return profile.scaled(speed["factor"]) if speed and speed["factor"] else profile

    entries = []
    for held in vs.points:
        factor = validate.point_speed(vs, profile, held, speed)
        _log(f"validation: {held.mode} {held.sweep} {held.length}@{held.qps:g} (seeds {list(held.seeds)})"
             + (f", host {factor['factor']:.3f}x the calibration's step costs" if factor and factor["factor"] else ""))
        predicted = await sim.run(held.mode, held.sweep, held.length, held.qps, list(held.seeds),
                                  profile=at_speed(factor))
        entry = {**validate.compare(held, predicted, s.slo_ms), "host_speed": factor}
        entries.append(validate.unjudge_compute(entry) if speed == "own" and factor else entry)
    knees = []
    overall = validate.host_speed(vs, profile) if speed != "calibration" else None
    if not seeds_only:
        seeds = sorted({sd for p in vs.points for sd in p.seeds})
        for mode in vs.modes():
            found = await search.find_limit(lambda v, mode=mode: sim.run(mode, "knee", s.qps_length, float(v), seeds,
                                                                        profile=at_speed(overall)),
                                            s.qps[0], slo_ms=s.slo_ms, key="qps", resolution=RESOLUTION,
                                            floor=s.qps_floor, ceiling=max(s.qps) * 2)
            knees.append(validate.knee_check(mode, vs.limits.get(mode), list(s.qps), found.limit, RESOLUTION))
    return {"validation": entries, "validation_knees": knees,
            "validation_summary": validate.summary(entries, knees),
            "validation_host_speed": overall,
            "validation_speed": speed if vs.step_log else "calibration",
            "validation_source": {"profile": str(vs.profile_file), "held_out": str(vs.held_out_file),
                                  "protocol": pr, "profile_host": profile.host.get("cpu")}}


def shared_cores(args: argparse.Namespace) -> bool:
    """Whether the simulated cores are processor-shared (``--cores``; ``--shared-cores`` is its older spelling)."""
    return bool(args.shared_cores) or args.cores == "shared"


def validation_speed(args: argparse.Namespace) -> str:
    """``--speed`` (``--calibration-speed`` is the older spelling of ``--speed calibration``)."""
    return str(args.speed or ("calibration" if args.calibration_speed else "neighbours"))


def run_simulate(args: argparse.Namespace) -> int:
    from grstack.runtime.errors import UserError
    from grstack.runtime.serve import run_virtual

    t0 = time.perf_counter()
    quick = bool(args.quick)
    result: dict[str, Any] = {}
    vdir = Path(args.validation) if args.validation else VALIDATION_DIR

    def validation() -> dict[str, Any]:
        return {} if args.no_validation else run_virtual(
            lambda: validation_part(vdir, out=Path(args.out) / "simulate" / "validation",
                                    speed=validation_speed(args), shared_cores=shared_cores(args)))

    if args.calibration_speed and args.speed not in (None, "calibration"):
        raise UserError(f"--calibration-speed and --speed {args.speed} each set the validation's host speed: give one")
    if args.shared_cores and args.cores == "fcfs":
        raise UserError("--shared-cores and --cores fcfs contradict each other")
    if args.validation_only and args.no_validation:
        raise UserError("--validation-only and --no-validation contradict each other")
    if args.plan:
        result.update(validation())
        result["plan"] = run_virtual(lambda: plan_part(args, quick))
    elif args.validation_only:
        result.update(validation())
    else:
        result.update(scale_part(args, quick, before_wait=validation))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    safe = _json_safe(result)
    out = Path(args.out) / "simulate"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve-simulate.json").write_text(json.dumps(safe, indent=2))
    if not args.plan:
        from grstack.runtime.bench.serve_sim_plot import plot_simulation

        safe["plot"] = str(plot_simulation(safe, out / "serve-simulate.png"))
        _log(f"plot {safe['plot']}")
    brief = {k: v for k, v in safe.items() if k != "modes"}
    print(json.dumps(brief if args.json else safe))
    return 0


async def plan_part(args: argparse.Namespace, quick: bool) -> dict[str, Any]:
    """The fewest replicas meeting the SLO at ``--qps`` per device memory option, relay and full inference."""
    from grstack.runtime.errors import UserError

    if args.qps is None:
        raise UserError("--plan: --qps Q is needed (the traffic to plan for)")
    try:
        qps = float(args.qps)
    except ValueError:
        raise UserError(f"--plan: --qps takes one rate, got {args.qps!r}") from None
    preset = PAPER_QUICK if quick else PAPER_FULL
    profile = load_profile(args.model)
    options = [float(x) for x in (args.device_gb_options or "").split(",") if x.strip()]
    base = paper_deployment(profile, 1, 1, args.device_gb, args.dram_gb,
                            shared_cores=shared_cores(args))
    if not options:
        options = [base.device_cache_mb / 1024 * f for f in (0.25, 0.5, 1.0)]
    s = _paper_settings(args, preset, profile, base)
    s.lengths = [s.qps_length]
    s.device_cache_total_bytes = 0  # the traffic is the user's: not re-sized to each candidate deployment
    model, tasks, max_len = _model(s)
    seeds = [s.seed + k for k in range(s.seeds)]
    out: dict[str, Any] = {"qps": qps, "slo_ms": s.slo_ms, "length": s.qps_length, "profile": profile.source,
                           "options_gb": options}
    for mode in ("relay", "baseline"):
        async def meets(replicas: int, device_bytes: float, mode: str = mode) -> bool:
            dep = replace(base, replicas=replicas, servers=max(1, math.ceil(replicas / 8)),
                          device_cache_mb=device_bytes / MB)
            sim = Simulator(s, dep, profile, model, tasks, max_len)
            point = await sim.run(mode, "plan", s.qps_length, qps, seeds)
            return bool(point["meets_slo"])
        out[mode] = await search.plan_capacity(meets, [g * GB for g in options], max_replicas=args.max_replicas)
    return out

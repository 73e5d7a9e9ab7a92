"""``grstack bench serve``: relay-race ranking vs full inference under open-loop Poisson load.

Set-up (one machine): one ranker process (1 torch thread) and two in-process routers in front of it, one
with relay on (sequence-aware trigger + prefix cache) and one with relay off (the baseline: the same ranker,
every rank is full inference). The model is an untrained HSTU (latency does not depend on the weights)
with ``max_len`` covering the sweep.

Workload per point: ``users`` users, each with a fixed long-term history of ``length`` events (it changes
slowly: a daily batch in production), sends rank requests at Poisson times (``qps``); every rank carries
16 fresh short-term events and 64 candidates and is preceded by a prefill signal ``lead_ms`` earlier (the
retrieval stage sends it). Relay points start with each user's prefill signalled once (a session's first
signal), off the clock; the measured phase then shows steady-state behaviour, with the hit rate reported.

Sweeps: prefix length at a fixed QPS, then QPS at the longest length at which the baseline's P99 stayed
within half the SLO (so its QPS limit lies inside the sweep; if it misses even the lowest QPS, the sweep
goes down by halves to 0.5 QPS); a mode's sweep stops after two
consecutive points miss the P99 SLO, or after one whose median is already above half the SLO (longer/faster
points are only worse; a single miss with a fast median may be a stall of this shared machine). ``max_len_at_slo`` / ``max_qps_at_slo`` are the largest
swept values meeting the SLO. ``max_abs_score_diff`` compares scores the relay service returned
against ``HSTU.encode`` + ``rank_logits`` over the full sequence, in fp32, in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUICK = {"lengths": [512, 1024, 2048, 4096, 8192], "qps": [2, 4, 8, 16, 32, 64, 128, 256], "point_s": 5.0,
         "min_requests": 20, "users": 4}
# At risk: full inference predicted above 5% of the SLO (12.5 ms at 250 ms). Its P99 under load is many times
# the bare time, and the profile may be taken while the machine is quieter than during the sweep.
RISK_FRACTION = 0.05
FULL = {"lengths": [256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192],
        "qps": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256], "point_s": 20.0, "min_requests": 100,
        "users": 12}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a coarse sweep (about two minutes)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object (no summary)")
    parser.add_argument("--out", default="runs/bench-serve", help="model, plot and full results go here")
    parser.add_argument("--slo-ms", type=float, default=250.0, help="P99 SLO of a rank request (default 250)")
    parser.add_argument("--length-qps", type=float, default=4.0, help="QPS of the length sweep (default 4)")
    parser.add_argument("--qps-length", type=int, default=None,
                        help="prefix length of the QPS sweep (default: the longest length at which the baseline "
                             "met the SLO in the length sweep)")
    parser.add_argument("--lengths", default=None, help="comma-separated prefix lengths (overrides the preset)")
    parser.add_argument("--qps", default=None, help="comma-separated QPS values (overrides the preset)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


@dataclass
class Workload:
    short: int = 16
    candidates: int = 64
    lead_ms: float = 20.0
    num_items: int = 20_000
    max_suffix: int = 64
    timeout_s: float = 3.0


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def _history(rng: Any, n: int, num_items: int, t0: int) -> tuple[list[int], list[int]]:
    items = rng.integers(1, num_items + 1, n).tolist()
    ts = (t0 + rng.integers(30, 3600, n).cumsum()).tolist()
    return items, ts


def build_point(mode: str, length: int, qps: float, n: int, users: int, wl: Workload, seed: int) -> dict[str, Any]:
    """Pre-encoded prefill/rank requests of one sweep point (identical for both modes but the user ids)."""
    import numpy as np

    from grstack.runtime.serve import Request, poisson_times

    rng = np.random.default_rng([seed, length, int(qps * 10)])
    hist = {}
    for u in range(users):
        hist[f"{mode}-L{length}-q{qps:g}-u{u}"] = _history(rng, length, wl.num_items, 1_600_000_000)
    names = list(hist)
    times = poisson_times(qps, n, rng)
    reqs, ranks = [], []
    for t in times:
        user = names[int(rng.integers(0, users))]
        items, ts = hist[user]
        s_items, s_ts = _history(rng, wl.short, wl.num_items, ts[-1])
        body = {"user_id": user, "long_term": {"items": items, "timestamps": ts},
                "short_term": {"items": s_items, "timestamps": s_ts},
                "candidates": rng.integers(1, wl.num_items + 1, wl.candidates).tolist(), "timestamp": s_ts[-1] + 1}
        pre = {"user_id": user, "long_term": {"items": items, "timestamps": ts}}
        reqs.append(Request(max(0.0, t - wl.lead_ms / 1e3), "/v1/prefill", json.dumps(pre).encode(), user, False))
        reqs.append(Request(float(t), "/v1/rank", json.dumps(body).encode(), user, True))
        ranks.append(body)
    warm = [json.dumps({"user_id": u, "long_term": {"items": hist[u][0], "timestamps": hist[u][1]},
                        "wait": True}).encode() for u in names]
    return {"requests": reqs, "ranks": ranks, "warm": warm}


async def _warm_up(session: Any, url: str, bodies: list[bytes], deadline_s: float = 60.0) -> dict[str, int]:
    """Signals each user's prefix once and waits for it; retries while the trigger's load budget is full.
    Returns the trigger's decisions by reason."""
    reasons: dict[str, int] = {}
    end = time.monotonic() + deadline_s
    for body in bodies:
        while True:
            async with session.post(url + "/v1/prefill", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                out = await resp.json()
            if out.get("reason") != "load-budget" or time.monotonic() > end:
                reasons[out.get("reason", "error")] = reasons.get(out.get("reason", "error"), 0) + 1
                break
            await asyncio.sleep(0.2)
    return reasons


async def _drain(session: Any, ranker_url: str, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        async with session.get(ranker_url + "/v1/stats") as resp:
            if (await resp.json())["queued"] == 0:
                return
        await asyncio.sleep(0.1)


async def _measure(session: Any, router_url: str, ranker_url: str, mode: str, length: int, qps: float,
                   sweep: str, cfg: dict[str, Any], wl: Workload, seed: int, slo_ms: float,
                   keep: list[dict[str, Any]]) -> dict[str, Any]:
    import numpy as np

    from grstack.runtime.serve import latency_summary, run_open_loop

    n = max(cfg["min_requests"], int(qps * cfg["point_s"]))
    point = build_point(mode, length, qps, n, cfg["users"], wl, seed)
    if mode == "relay":
        reasons = await _warm_up(session, router_url, point["warm"])
        if reasons.get("admitted", 0) + reasons.get("live", 0) < len(point["warm"]):
            _log(f"trigger at length {length}: {reasons} (prefixes not admitted are ranked by full inference)")
    results = await run_open_loop(router_url, point["requests"], timeout_s=wl.timeout_s, session=session)
    await _drain(session, ranker_url)
    summary = latency_summary(results)
    ranks = [r for r in results if r.request.measure]
    hits = sum(1 for r in ranks if r.status == 200 and r.payload and r.payload.get("cache") != "miss")
    compute = [r.payload["compute_ms"] for r in ranks if r.status == 200 and r.payload]
    out = {"sweep": sweep, "length": length, "qps": qps, **summary,
           "meets_slo": bool(summary["p99_ms"] <= slo_ms), "hit_rate": hits / max(1, len(ranks)),
           "ranker_compute_p50_ms": float(np.median(compute)) if compute else None}
    if mode == "relay" and length <= 2048:  # responses to check against full inference
        for body, r in list(zip(point["ranks"], ranks, strict=True))[:3]:
            if r.status == 200 and r.payload is not None and r.payload["cache"] != "miss":
                keep.append({"body": body, "scores": r.payload["scores"]})
    _log(f"{mode:8s} {sweep:6s} length={length:5d} qps={qps:6.1f} n={summary['n']:4d} "
         f"p50={summary['p50_ms']:8.1f} ms p99={summary['p99_ms']:8.1f} ms errors={summary['errors']} "
         f"hit_rate={out['hit_rate']:.2f} compute_p50={out['ranker_compute_p50_ms'] or 0:.1f} ms")
    return out


def _qps_length(baseline: list[dict[str, Any]], relay_router: Any, slo_ms: float, default: int) -> int:
    """The longest length with baseline headroom (P99 <= SLO/2) that the trigger pre-infers (else relay is
    the baseline there, by design); failing that, the longest with headroom."""
    roomy = [p["length"] for p in baseline if p["sweep"] == "length" and p["p99_ms"] <= slo_ms / 2]
    trig = relay_router.trigger
    risky = [n for n in roomy if trig is not None and trig.at_risk(n)[0]]
    return max(risky or roomy or [default])


def _limit(points: list[dict[str, Any]], key: str) -> float | int | None:
    ok = [p[key] for p in points if p["meets_slo"]]
    return max(ok) if ok else None


def _score_diff(checkpoint: Path, kept: list[dict[str, Any]], max_suffix: int) -> float:
    """Relay scores vs HSTU.encode + rank_logits of the whole (truncated) sequence, fp32."""
    import numpy as np

    from grstack.runtime.serve import RelayEngine, load_ranking_model

    model, _ = load_ranking_model(checkpoint)
    eng = RelayEngine(model, max_suffix=max_suffix)
    worst = 0.0
    for k in kept:
        b = k["body"]
        item = eng.canonical(b["long_term"]["items"], b["long_term"]["timestamps"], b["short_term"]["items"],
                             b["short_term"]["timestamps"], b["candidates"], b["timestamp"])
        ref = eng.rank_encode([item])[0].numpy()
        worst = max(worst, float(np.abs(ref - np.asarray(k["scores"], dtype=np.float32)).max()))
    return worst


def _capped(ms: float | None, cap: float = 1e4) -> float:
    """Failed requests make P99 infinite (None in JSON); plot them at the cap."""
    return cap if ms is None else min(ms, cap)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("baseline", "o-"), ("relay", "s-")):
        pts = [p for p in result[mode]["points"] if p["sweep"] == "length"]
        axes[0].plot([p["length"] for p in pts], [_capped(p["p99_ms"]) for p in pts], style, label=mode)
        pts = [p for p in result[mode]["points"] if p["sweep"] == "qps"]
        axes[1].plot([p["qps"] for p in pts], [_capped(p["p99_ms"]) for p in pts], style, label=mode)
    for ax, xlabel in ((axes[0], "long-term prefix length (tokens)"), (axes[1], "offered load (QPS)")):
        ax.axhline(result["slo_ms"], color="gray", linestyle="--", label=f"SLO {result['slo_ms']:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("P99 latency (ms)")
        ax.legend()
    axes[0].set_title("P99 vs length")
    axes[1].set_title("P99 vs QPS")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def _bench(args: argparse.Namespace, cfg: dict[str, Any], wl: Workload) -> dict[str, Any]:
    import aiohttp

    from grstack.runtime.serve import (
        Router,
        RouterConfig,
        TriggerConfig,
        spawn_ranker,
        start_router,
        write_untrained_model,
    )

    out_dir = Path(args.out)
    max_len = max(max(cfg["lengths"]), args.qps_length or 0) + wl.max_suffix
    checkpoint = write_untrained_model(out_dir / "model.pt", num_items=wl.num_items, max_len=max_len, seed=args.seed)
    _log(f"model: untrained HSTU (d=64, 2 blocks, 2 heads, dqk=dv=32), max_len {max_len}; starting the ranker")
    ranker = await spawn_ranker(checkpoint, ["--device", "cpu", "--threads", "1", "--max-suffix", str(wl.max_suffix),
                                             "--device-cache-mb", "24", "--dram-cache-mb", "1024",
                                             "--max-candidates", str(wl.candidates), "--log-level", "WARNING"])
    trig = TriggerConfig(slo_ms=args.slo_ms, risk_fraction=RISK_FRACTION)
    routers = {}
    routers_obj: dict[str, Any] = {}
    try:
        for mode in ("baseline", "relay"):
            rc = RouterConfig(rankers=(ranker.url,), relay=mode == "relay", trigger=trig,
                              prefill_budget_per_replica_ms=1000.0, rank_timeout_s=wl.timeout_s + 2)
            router = Router(rc)
            routers_obj[mode] = router
            routers[mode] = await start_router(router)
            if mode == "relay" and router.trigger is not None:
                risk = {L: router.trigger.at_risk(L) for L in sorted({*cfg["lengths"], args.qps_length or 0} - {0})}
                _log("trigger (latency model from the ranker's profile): " + ", ".join(
                    f"{L}: {ms:.0f} ms{' at risk' if r else ''}" for L, (r, ms) in risk.items()))
        kept: list[dict[str, Any]] = []
        points: dict[str, list[dict[str, Any]]] = {"baseline": [], "relay": []}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024)) as session:
            for sweep, values in (("length", cfg["lengths"]), ("qps", cfg["qps"])):
                if sweep == "qps" and args.qps_length is None:
                    args.qps_length = _qps_length(points["baseline"], routers_obj["relay"], args.slo_ms,
                                                  min(cfg["lengths"]))
                    _log(f"QPS sweep at length {args.qps_length}: the longest at which the baseline's P99 stayed "
                         f"within half the SLO at {args.length_qps:g} QPS and the trigger pre-infers")
                stopped = {"baseline": False, "relay": False}
                misses = {"baseline": 0, "relay": 0}
                for v in values:
                    length, qps = (v, args.length_qps) if sweep == "length" else (args.qps_length, v)
                    for mode in ("baseline", "relay"):
                        if stopped[mode]:
                            continue
                        p = await _measure(session, routers[mode][1], ranker.url, mode, length, qps, sweep, cfg,
                                           wl, args.seed, args.slo_ms, kept)
                        points[mode].append(p)
                        lower = qps
                        while sweep == "qps" and v == values[0] and not p["meets_slo"] and lower / 2 >= 0.5:
                            lower /= 2  # the limit is below the sweep: look further down
                            p = await _measure(session, routers[mode][1], ranker.url, mode, length, lower, sweep,
                                               cfg, wl, args.seed, args.slo_ms, kept)
                            points[mode].insert(0, p)
                            points[mode].sort(key=lambda x: (x["sweep"] == "qps", x["length"], x["qps"]))
                        misses[mode] = 0 if points[mode][-1]["meets_slo"] else misses[mode] + 1
                        # A miss with a slow median is the work itself, not a stall of the machine.
                        last = points[mode][-1]
                        stopped[mode] = misses[mode] >= 2 or (misses[mode] == 1 and last["p50_ms"] > args.slo_ms / 2)
            async with session.get(ranker.url + "/v1/stats") as resp:
                stats = await resp.json()
        _log(f"checking {len(kept)} relay responses against full inference")
        diff = _score_diff(checkpoint, kept, wl.max_suffix)
    finally:
        for runner, _ in routers.values():
            await runner.cleanup()
        await ranker.stop()
    result: dict[str, Any] = {"slo_ms": args.slo_ms}
    for mode in ("baseline", "relay"):
        pts = points[mode]
        result[mode] = {"points": pts,
                        "max_len_at_slo": _limit([p for p in pts if p["sweep"] == "length"], "length"),
                        "max_qps_at_slo": _limit([p for p in pts if p["sweep"] == "qps"], "qps")}
    relay = points["relay"]
    result["relay"]["hit_rate"] = sum(p["hit_rate"] * p["n"] for p in relay) / max(1, sum(p["n"] for p in relay))
    result["relay"]["device_bytes"] = stats["device_bytes"]
    result["relay"]["dram_bytes"] = stats["dram_bytes"]
    ratio = lambda a, b: (a / b) if a is not None and b else None  # noqa: E731
    result["max_len_ratio"] = ratio(result["relay"]["max_len_at_slo"], result["baseline"]["max_len_at_slo"])
    result["slo_qps_ratio"] = ratio(result["relay"]["max_qps_at_slo"], result["baseline"]["max_qps_at_slo"])
    result["max_abs_score_diff"] = diff
    return result


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.errors import UserError

    cfg = dict(QUICK if args.quick else FULL)
    if args.lengths:
        cfg["lengths"] = sorted(int(x) for x in args.lengths.split(","))
    if args.qps:
        cfg["qps"] = sorted(float(x) for x in args.qps.split(","))
    if args.slo_ms <= 0 or args.length_qps <= 0 or min(cfg["lengths"]) < 1 or min(cfg["qps"]) <= 0:
        raise UserError("--slo-ms, --length-qps, --lengths and --qps must be positive")
    wl = Workload()
    t0 = time.perf_counter()
    result = _json_safe(asyncio.run(_bench(args, cfg, wl)))
    plot = Path(args.out) / "serve-p99.png"
    _plot(result, plot)
    reached = {f"{mode}_{key}_limit_reached": any(not p["meets_slo"] for p in result[mode]["points"]
                                                   if p["sweep"] == sweep)
               for mode in ("baseline", "relay") for key, sweep in (("len", "length"), ("qps", "qps"))}
    details = {**result, **reached, "workload": {**wl.__dict__, "users_per_point": cfg["users"], "length_qps": args.length_qps,
                                      "qps_length": args.qps_length, "risk_fraction": RISK_FRACTION,
                                      "prefill_budget_ms_per_s": 1000.0, "device_cache_mb": 24},
               "plot": str(plot), "seconds": round(time.perf_counter() - t0, 1)}
    (Path(args.out) / "serve-bench.json").write_text(json.dumps(details, indent=2))
    if not args.json:
        _log(f"P99 SLO {result['slo_ms']:g} ms: max length {result['baseline']['max_len_at_slo']} -> "
             f"{result['relay']['max_len_at_slo']} (x{result['max_len_ratio']}), max QPS "
             f"{result['baseline']['max_qps_at_slo']} -> {result['relay']['max_qps_at_slo']} "
             f"(x{result['slo_qps_ratio']}); max |score diff| {result['max_abs_score_diff']:.2e}; plot {plot}; "
             f"{details['seconds']} s")
        for mode in ("relay",):
            for key in ("len", "qps"):
                if not reached[f"{mode}_{key}_limit_reached"]:
                    _log(f"{mode} met the SLO at every swept {'length' if key == 'len' else 'QPS'}: its limit "
                         f"(and the ratio) is at least what is shown")
    print(json.dumps(result))
    return 0

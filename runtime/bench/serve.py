"""``grstack bench serve``: relay-race serving measured as a cascade (docs/bench-serve.md has the protocol).

A trace of user visits (``serve_trace``: KuaiRand-like synthetic users and history lengths, Zipf activity,
bursts of visits in sessions, sessions at least the DRAM TTL apart, signals whose rank does not always come)
is replayed open-loop against two ranker processes behind an in-process router: each visit sends the
pre-infer signal at its time and the rank request a cascade gap later. Pre-inference runs on the clock, on the
same rankers, warm-up included; nothing is pre-loaded. Every mode (the baselines full inference and
prefix_cache, relay, and the ablations no_trigger, no_affinity, no_expander) gets ranker processes of its own,
so no mode inherits another's caches, and the modes' points run interleaved (each sweep step measures every
mode in turn), so that the host's speed drifting over the run hits them alike. A point passes when its P99
(failed or shed ranks count as infinite) is within the SLO, fixed before measuring; a mode's limit is the
largest swept value for which it and every smaller swept value pass, and its sweep stops at the first
failing point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from grstack.runtime.bench import cpu_pinning, host_cpu
from grstack.runtime.bench.serve_trace import (
    Population,
    Trace,
    TraceConfig,
    build_trace,
    max_long_bound,
    population,
)

# The QPS sweep runs at 512 tokens (both presets): on two 1-thread rankers sharing 2 cores with the load
# generator, the baseline can fail 1024-token histories at every QPS down to the floor, which would leave
# slo_qps_ratio without a denominator. --quick is meant to finish within about 15 minutes with 1,000 measured ranks per point, so its
# points are few and fast: 4 lengths at 40 QPS (about 37 s a point). Its QPS sweep starts at the length sweep's
# 40 QPS (the same point, not measured again; a mode failing it is probed down to 10 QPS) and steps by 1.5 or 2
# to 240, so that limits between 80 and 160 QPS are resolved (docs/bench-serve.md, Measurement).
QUICK: dict[str, Any] = {"users": 2000, "lengths": [256, 512, 1024, 2048], "length_qps": 40.0,
                         "qps": [40.0, 80.0, 120.0, 160.0, 240.0], "qps_length": 512, "repeats": 1,
                         "qps_floor": 10.0}
FULL: dict[str, Any] = {"users": 10_000, "lengths": [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192],
                        "length_qps": 20.0, "qps": [10.0, 20.0, 30.0, 40.0, 60.0, 80.0, 120.0, 160.0, 240.0, 320.0],
                        "qps_length": 512, "repeats": 3, "qps_floor": 2.5}
MODES = ("baseline", "prefix_cache", "relay", "no_trigger", "no_affinity", "no_expander")
# The two baselines relay is compared with (relay_vs_full, relay_vs_prefix_cache): full inference, and an LLM
# server's automatic prefix cache (a rank's KV kept on the device for the user's next requests; nothing
# pre-inferred on the retrieval signal, no DRAM tier).
BASELINES = ("baseline", "prefix_cache")
ABLATIONS = ("no_trigger", "no_affinity", "no_expander")
RANKERS = 2  # per mode, the protocol's (--rankers)
DEVICE_CACHE_MB = 64  # each ranker's device tier (--device-cache-mb)
DRAM_CACHE_MB = 1024  # each ranker's DRAM tier, in the modes that have one
DRAM_TTL_S = 600.0  # the rankers' DRAM TTL; the trace keeps a user's sessions at least this far apart
# cached bytes per prefix token of the benchmark's model (write_untrained_model's defaults: 2 blocks x 2 heads
# x (dqk 32 + dv 32) fp32 keys and values, and an int64 timestamp): what the trace's cache pressure reads
KV_BYTES_PER_TOKEN = 2 * 2 * (32 + 32) * 4 + 8
CACHE_PRESSURE = 10.0  # the visited users' prefixes need this many times all rankers' device tiers
FOLLOW_THROUGH = 0.8  # share of pre-infer signals whose rank comes
TRACES = ("protocol", "uniform")  # --trace: the relay-testing protocol, or the earlier uniform trace
# The rankers run at this niceness. This process is the load generator and the router; on a real test bed both
# have cores of their own. Sharing cores at equal priority, the load generator's event loop waits for a core
# behind the rankers' compute, and that wait lands in every latency it measures (docs/bench-serve.md, System
# under test). Niced rankers yield the core to it, and get every cycle it does not use.
RANKER_NICE = 10
QPS_FLOOR = 2.5  # a mode failing the lowest swept QPS is probed down by halves to here
MAX_SUFFIX = 64
MAX_LENGTH = 50_000  # half of what a request may carry (serving's MAX_EVENTS), the rest for growth
CANDIDATES = 64
SCORE_SAMPLES_PER_POINT = 8
SCORE_SAMPLES_MAX = 64
SCORE_SAMPLES_MIN = 30
# trace, the trace's tail (heavy users waiting out their gap), drain and stats per point (about 6-9 s at 40
# QPS; used only for the estimate)
POINT_OVERHEAD_S = 6.0
START_S = 30.0  # every mode's rankers started, one mode's at a time, and stopped; the overload run's too
# Rankers started at once: one mode's (Settings.rankers). A ranker measures its latency profile (what the
# trigger's risk test reads) while it starts; four starting together on 2 cores measure full-inference times
# 2-3x those of two, which skews the trigger. So they start one mode's rankers at a time.
HOST_BUSY_WARN = 0.25  # cores used by other processes before the run above which it warns


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--quick", action="store_true", help="the quick protocol (2,000 users, 1 repeat)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object (no summary)")
    parser.add_argument("--out", default="runs/bench-serve", type=ca.output_dir,
                        help="model, plot and full results go here")
    parser.add_argument("--slo-ms", type=ca.positive_float, default=100.0,
                        help="P99 SLO of a rank request (default 100)")
    parser.add_argument("--cascade-gap-ms", type=ca.non_negative_float, default=50.0,
                        help="pre-infer signal to rank request (default 50, jittered +-20%%)")
    parser.add_argument("--users", type=ca.positive_int, default=None, help="synthetic users per point (default 10,000; "
                                                                "--quick 2,000)")
    parser.add_argument("--lengths", default=None, help="comma-separated base long-term lengths")
    parser.add_argument("--qps", default=None, help="comma-separated QPS values")
    parser.add_argument("--length-qps", type=ca.positive_float, default=None, help="QPS of the length sweep")
    parser.add_argument("--qps-length", type=ca.positive_int, default=None,
                        help="base length of the QPS sweep (default 512)")
    parser.add_argument("--repeats", type=ca.positive_int, default=None,
                        help="trace seeds per point (default 3; --quick 1)")
    parser.add_argument("--measured", type=ca.positive_int, default=None, help="measured rank requests per point (default "
                                                                  "1000, the protocol's minimum)")
    parser.add_argument("--warmup", type=ca.non_negative_int, default=None, help="visits sent before measuring (default 250)")
    parser.add_argument("--qps-floor", type=ca.positive_float, default=None,
                        help="a mode failing the lowest QPS is probed down by halves to this (default 2.5; "
                             "--quick 10)")
    parser.add_argument("--trace", choices=TRACES, default="protocol",
                        help="protocol: heterogeneous lengths, follow-through 0.8, sessions a DRAM TTL apart, sized "
                             "for 10x cache pressure (docs/bench-serve.md); uniform: every user the same base "
                             "length, every signal followed, sessions compressed (the trace of results before "
                             "2026-12-04)")
    parser.add_argument("--min-user-gap-s", type=ca.non_negative_float, default=1.0,
                        help="one user's consecutive visits are at least this far apart (default 1 s)")
    parser.add_argument("--rankers", type=ca.positive_int, default=RANKERS,
                        help=f"one-thread rankers per mode (default {RANKERS})")
    parser.add_argument("--ranker-cpus", default=None,
                        help="CPUs the rankers run on, e.g. 1 or 2-11 (Linux; default: any)")
    parser.add_argument("--harness-cpus", default=None,
                        help="CPUs this process (load generator and routers) runs on, e.g. 0 (Linux; default: any)")
    parser.add_argument("--seed", type=ca.seed, default=0, help="seed of the synthetic users and traces")
    parser.add_argument("--modes", default=None, metavar="M,...",
                        help=f"the modes to measure (default all: {','.join(MODES)}); baseline and relay are "
                             "always among them")
    parser.add_argument("--calibrate", nargs="?", const="", default=None, type=_profile_file, metavar="FILE",
                        help="instead of the sweeps: run the rankers at a few load points and write the cost "
                             "profile fitted to their logged steps to FILE (default OUT/cost-profile.json)")
    g = parser.add_argument_group("simulation (--simulate: the real control plane on virtual time, "
                                  "docs/serve-simulator.md)")
    g.add_argument("--simulate", action="store_true",
                   help="instead of real rankers: validate the simulator against the stored real runs, then "
                        "find every mode's limits at the paper-scale protocol on virtual time")
    g.add_argument("--model", default="paper", metavar="paper|FILE",
                   help="--simulate's costs: paper (a 0.2B HSTU in bf16 on an H200, a model) or a cost profile "
                        "from --calibrate")
    g.add_argument("--replicas", type=ca.positive_int, default=None, help="--simulate: rankers (default 2; full 8)")
    g.add_argument("--servers", type=ca.positive_int, default=None,
                   help="--simulate: servers the replicas are split over, one shared DRAM tier each (default 1)")
    g.add_argument("--device-gb", type=ca.positive_float, default=None,
                   help="--simulate: device KV tier per replica (default: the H200's memory beside the weights)")
    g.add_argument("--dram-gb", type=ca.positive_float, default=None,
                   help="--simulate: DRAM tier per server (default 1536)")
    g.add_argument("--seeds", type=ca.positive_int, default=None, help="--simulate: trace seeds per point")
    g.add_argument("--validation", default=None, metavar="DIR",
                   help="--simulate: the stored real runs to validate against (default: the set shipped with grstack, runtime/bench/serve_validation)")
    g.add_argument("--no-validation", action="store_true", help="--simulate: skip the validation")
    g.add_argument("--validation-only", action="store_true",
                   help="--simulate: only the validation (about a minute; deterministic), not the paper scale")
    g.add_argument("--speed", choices=("neighbours", "others", "calibration", "own"), default=None,
                   help="--simulate: the host speed each held-out point is predicted at, from the held-out run's "
                        "step log: its repeats nearest in time (neighbours, the default), all its other points "
                        "(others), the calibration's (calibration), or, a diagnostic, the point's own steps "
                        "(own: its compute per visit not judged); docs/serve-simulator.md")
    g.add_argument("--calibration-speed", action="store_true", help="--simulate: the same as --speed calibration")
    g.add_argument("--cores", choices=("shared", "fcfs"), default="shared",
                   help="--simulate: a replica's cores shared by all its running work at once, as the kernel's "
                        "scheduler shares them (shared: processor sharing, the default), or held by one piece of "
                        "work at a time, first come first served (fcfs)")
    g.add_argument("--shared-cores", action="store_true", help="--simulate: the same as --cores shared")
    g.add_argument("--plan", action="store_true",
                   help="--simulate: the fewest replicas meeting --slo-ms at --qps Q, per device memory, relay "
                        "and full inference")
    g.add_argument("--device-gb-options", default=None, metavar="G,...",
                   help="--plan: device memory per replica to plan for (default: a quarter, half and all of it)")
    g.add_argument("--max-replicas", type=ca.positive_int, default=256, help="--plan: search up to this many")
    g.add_argument("--jobs", type=ca.positive_int, default=None,
                   help="--simulate: worker processes the modes' searches run in (default: the cores, at most 6)")
    parser.add_argument("--calibrate-points", default=None, metavar="L:Q,...",
                        help="--calibrate's load points as length:qps pairs (default: the preset's)")
    parser.set_defaults(func=run)


def _profile_file(text: str) -> str:
    from grstack.runtime import cli_args as ca

    return ca.output_file(text) if text else text


@dataclass
class Settings:
    users: int
    lengths: list[int]
    length_qps: float
    qps: list[float]
    qps_length: int
    repeats: int
    slo_ms: float
    gap_ms: float
    measured: int
    warmup: int
    seed: int
    out: Path
    qps_floor: float = QPS_FLOOR
    min_user_gap_s: float = 1.0
    timeout_s: float = 10.0  # the load generator's; the router answers 504 at the SLO long before
    rankers: int = RANKERS
    ranker_cpus: frozenset[int] | None = None
    harness_cpus: frozenset[int] | None = None
    trace_kind: str = "protocol"
    modes: tuple[str, ...] = MODES
    pops: dict[int, Population] = field(default_factory=dict)

    def trace_config(self, length: int, qps: float, repeat: int) -> TraceConfig:
        if self.trace_kind == "uniform":  # one base length, every signal followed, no TTL or cache sizing
            return TraceConfig(users=self.users, length=length, qps=qps, warmup=self.warmup,
                               measured=self.measured, gap_ms=self.gap_ms, max_short=MAX_SUFFIX,
                               candidates=CANDIDATES, min_user_gap_s=self.min_user_gap_s, seed=self.seed + repeat,
                               length_dist="fixed", follow_through=1.0, dram_ttl_s=DRAM_TTL_S,
                               keep_sessions_apart=False)
        return TraceConfig(users=self.users, length=length, qps=qps, warmup=self.warmup, measured=self.measured,
                           gap_ms=self.gap_ms, max_short=MAX_SUFFIX, candidates=CANDIDATES,
                           min_user_gap_s=self.min_user_gap_s, seed=self.seed + repeat,
                           follow_through=FOLLOW_THROUGH, dram_ttl_s=DRAM_TTL_S,
                           kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                           device_cache_bytes=self.rankers * (DEVICE_CACHE_MB << 20), cache_pressure=CACHE_PRESSURE,
                           pressure_length=min(*self.lengths, self.qps_length))

    def population(self, repeat: int) -> Population:
        seed = self.seed + repeat
        if seed not in self.pops:
            self.pops[seed] = population(self.users, seed)
        return self.pops[seed]

    def trace(self, length: int, qps: float, repeat: int) -> Trace:
        return build_trace(self.population(repeat), self.trace_config(length, qps, repeat))

    def point_seconds(self, qps: float) -> float:
        return (self.warmup + self.measured) / qps + POINT_OVERHEAD_S

    def total_seconds(self, modes: int | None = None, probe: bool = False) -> float:
        """Every mode when every swept point runs (a failing sweep stops earlier), plus the overload run;
        ``probe``: plus the points below a failing lowest QPS (slow: a point at 2.5 QPS takes
        (warm-up + measured) / 2.5 s)."""
        shared = self.qps_length in self.lengths and self.length_qps in self.qps
        pts = [self.point_seconds(self.length_qps) for _ in self.lengths] + [
            self.point_seconds(q) for q in self.qps if not (shared and q == self.length_qps)]
        lower = self.qps[0] / 2
        while probe and lower >= self.qps_floor:
            pts.append(self.point_seconds(lower))
            lower /= 2
        n = len(self.modes) if modes is None else modes
        return START_S + n * self.repeats * sum(pts) + self.point_seconds(3 * self.qps[0])


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


# -- the sweep rules (pure) ---------------------------------------------------------------------------
def sweep_limit(points: list[dict[str, Any]], key: str) -> float | int | None:
    """The largest value for which the point and every smaller swept point passed; None if the smallest
    failed (or nothing was swept)."""
    best = None
    for p in sorted(points, key=lambda p: p[key]):
        if not p["meets_slo"]:
            break
        best = p[key]
    return best


def rotated(modes: list[str], k: int) -> list[str]:
    """``modes`` starting at position ``k`` (mod its length): each step of a sweep starts with another mode."""
    if not modes:
        return []
    k %= len(modes)
    return modes[k:] + modes[:k]


def repeat_order(order: list[str], repeats: int) -> list[tuple[str, int]]:
    """(mode, repeat) in the order one sweep value measures them: each repeat measures every mode in turn, the
    order rotated by one from repeat to repeat, so a mode's repeats sit in different places among the others'."""
    return [(m, rep) for rep in range(repeats) for m in rotated(order, rep)]


Step = Callable[[list[str], float], Awaitable[dict[str, dict[str, Any]]]]


async def run_sweeps(modes: list[str], values: list[float], measure_step: Step,
                     floor: float | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each mode's sweep (ascending ``values``, stopping at its first failing point; with ``floor``, a mode
    whose lowest value fails is probed down by halves to ``floor`` until a point passes), interleaved: at each
    value ``measure_step(order, value)`` measures every mode still sweeping, in ``order``, which rotates by one
    from value to value, and returns each one's point. The host's speed drifts over minutes on a shared
    machine; run one mode after another, the drift lands on whole modes (docs/bench-serve.md, Measurement),
    interleaved it lands on all of them alike."""
    points: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    ordered = sorted(values)
    active, probing = list(modes), []
    step = 0
    for i, v in enumerate(ordered):
        order = rotated(active, step)
        got = await measure_step(order, v) if order else {}
        for m in order:
            points[m].append(got[m])
            if not got[m]["meets_slo"]:
                active.remove(m)
                if floor is not None and i == 0:
                    probing.append(m)
        step += 1
    lower = ordered[0] / 2 if ordered else 0.0
    while probing and floor is not None and lower >= floor:
        order = rotated(probing, step)
        got = await measure_step(order, lower)
        for m in order:
            points[m].insert(0, got[m])
            if got[m]["meets_slo"]:
                probing.remove(m)
        lower /= 2
        step += 1
    return points


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def versus(mode: dict[str, Any], against: dict[str, Any]) -> dict[str, float | None]:
    """A mode's limits over another's: the fields of every comparison in the JSON."""
    return {"max_len_ratio": ratio(mode["max_len_at_slo"], against["max_len_at_slo"]),
            "slo_qps_ratio": ratio(mode["max_qps_at_slo"], against["max_qps_at_slo"])}


# -- one point ----------------------------------------------------------------------------------------
def encode(trace: Trace, tag: str) -> tuple[list[Any], dict[int, int]]:
    """The trace as loadgen requests (a signal and a rank per visit; warm-up ranks not measured), and the
    visit of each rank request (by ``id``: the load generator answers in send order, and a jittered gap can
    send a visit's rank after the next visit's)."""
    from grstack.runtime.serve import Request

    reqs, visit_of = [], {}
    lt_cache: dict[tuple[int, int], str] = {}
    for k, v in enumerate(trace.visits):
        user = f"{tag}-u{v.user}"
        key = (v.user, len(v.long_items))
        if key not in lt_cache:
            lt_cache[key] = json.dumps({"items": v.long_items.tolist(), "timestamps": v.long_ts.tolist()})
        lt = lt_cache[key]
        rest = {"short_term": {"items": v.short_items.tolist(), "timestamps": v.short_ts.tolist()},
                "candidates": v.candidates.tolist(), "timestamp": int(v.t)}
        pre = f'{{"user_id": "{user}", "long_term": {lt}}}'.encode()
        body = f'{{"user_id": "{user}", "long_term": {lt}, {json.dumps(rest)[1:]}'.encode()
        reqs.append(Request(v.wall_s, "/v1/prefill", pre, user, False))
        if v.ranked:  # else the signal's rank never comes (the trace's follow-through)
            rank = Request(v.rank_s, "/v1/rank", body, user, k >= trace.config.warmup)
            reqs.append(rank)
            visit_of[id(rank)] = k
    return reqs, visit_of


async def _ranker_state(session: Any, urls: list[str]) -> list[dict[str, Any]]:
    """Each ranker's /v1/stats (``joined``: ranks that joined an in-flight prefill)."""
    out = []
    for url in urls:
        async with session.get(url + "/v1/stats") as resp:
            stats = await resp.json()
        out.append({**stats, "joined": stats.get("joined_ranks", 0)})
    return out


_TRIGGER_LINE = re.compile(r'^grstack_router_trigger_total\{reason="([^"]+)"\} (\S+)$', re.MULTILINE)


async def _trigger_counts(session: Any, router_url: str) -> dict[str, float]:
    """The router's prefill-signal decisions so far, by reason (its ``/metrics``)."""
    async with session.get(router_url + "/metrics") as resp:
        text = await resp.text()
    return {reason: float(v) for reason, v in _TRIGGER_LINE.findall(text)}


GC_THRESHOLDS = (0.025, 0.05, 0.1)  # pause lengths counted per point (seconds; the histogram's bucket edges)


def gc_counts(metrics_text: str, name: str = "grstack_ranker_gc_pause_seconds") -> dict[str, float]:
    """From a Prometheus exposition: the pauses of histogram ``name`` (all generations) and how many took
    longer than each of :data:`GC_THRESHOLDS` (the count above that bucket edge)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, within = 0.0, dict.fromkeys(GC_THRESHOLDS, 0.0)
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            le = float(sample.labels["le"])
            if math.isinf(le):
                total += sample.value
            elif le in within:
                within[le] += sample.value
    return {"count": total, **{f"over_{int(t * 1000)}ms": total - within[t] for t in GC_THRESHOLDS}}


async def _ranker_gc(session: Any, urls: list[str]) -> dict[str, float]:
    """The rankers' garbage-collector pauses so far (:func:`gc_counts` of each ``/metrics``, summed)."""
    out: Counter[str] = Counter()
    for url in urls:
        try:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
        except Exception:  # a ranker that does not answer: its pauses are not counted
            continue
        out.update(gc_counts(text))
    return {"count": 0.0, **{f"over_{int(t * 1000)}ms": 0.0 for t in GC_THRESHOLDS}, **out}


def gc_summary(ranker_before: dict[str, float], ranker_after: dict[str, float],
               harness: list[float]) -> dict[str, Any]:
    """Garbage-collector pauses over a point: the rankers' (deltas) and this process's (the load generator
    and router), with the longest of this process's."""
    counts = {k: int(ranker_after[k] - ranker_before[k]) for k in ranker_after}
    mine = {"count": len(harness), **{f"over_{int(t * 1000)}ms": sum(p > t for p in harness) for t in GC_THRESHOLDS},
            "max_ms": round(max(harness) * 1e3, 1) if harness else 0.0}
    return {"rankers": counts, "harness": mine}


def trigger_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Signals decided over a point (warm-up included), by the trigger's reason: admitted, live, not-at-risk,
    cache-budget, load-budget, ... (what explains a relay point's hit rate)."""
    return {k: int(after[k] - before.get(k, 0.0)) for k in sorted(after) if after[k] - before.get(k, 0.0) > 0}


def _delta(before: list[dict[str, Any]], after: list[dict[str, Any]], key: str) -> float | None:
    if any(key not in s for s in before + after):
        return None
    return float(sum(a[key] - b[key] for a, b in zip(after, before, strict=True)))


def state_deltas(before: list[dict[str, Any]], after: list[dict[str, Any]], visits: int) -> dict[str, Any]:
    """Ranker-side counters over a point (all rankers; warm-up included): pre-inference's share of compute,
    the rankers' compute per visit sent (what bounds the QPS two rankers can serve at all, whatever the
    scheduling), prefill tokens, ranks that joined an in-flight prefill, and the cache bytes at the end."""
    share = per_visit = None
    if all(isinstance(s.get("compute_ms_total"), dict) for s in before + after):
        tot = Counter()
        for a, b in zip(after, before, strict=True):
            for k, v in a["compute_ms_total"].items():
                tot[k] += v - b["compute_ms_total"].get(k, 0.0)
        total = sum(tot.values())
        share = tot["prefill"] / total if total > 0 else None
        per_visit = total / visits if visits else None
    return {"prefill_cpu_share": share, "compute_ms_per_visit": per_visit,
            "prefill_tokens_computed": _delta(before, after, "prefill_tokens_computed"),
            "prefill_tokens_without_incremental": _delta(before, after, "prefill_tokens_without_incremental"),
            "joined_inflight_ranks": _delta(before, after, "joined"),
            "device_bytes": sum(s.get("device_bytes", 0) for s in after),
            "dram_bytes": sum(s.get("dram_bytes", 0) for s in after)}


def summarize(results: list[Any], slo_ms: float, planned: int | None = None) -> dict[str, Any]:
    """Latency, errors by kind and cache outcomes of the measured ranks (loadgen results). Fewer than
    ``planned`` measured results means the load generator gave up (``GiveUp``): the point's P99 is above the
    SLO whatever the unsent ranks would have done, so it is reported as infinite, with the sent ranks' own."""
    import numpy as np

    from grstack.runtime.serve import latency_summary

    ranks = [r for r in results if r.request.measure]
    lat = latency_summary(ranks)
    stopped = planned is not None and len(ranks) < planned
    early = {"stopped_early": stopped, "planned": planned if planned is not None else len(ranks)}
    if stopped:
        early["p99_ms_sent"] = lat["p99_ms"]
        lat = {**lat, "p99_ms": math.inf}
    kinds = Counter(r.kind for r in ranks)
    cache = Counter(r.payload.get("cache", "miss") for r in ranks if r.status == 200 and r.payload)
    ok = kinds.get("ok", 0)
    shed = [r.latency_ms for r in ranks if r.kind.startswith("shed")]
    sends = [r.request.at for r in ranks]
    span = (max(sends) - min(sends)) if len(sends) > 1 else 0.0
    served = [r.latency_ms for r in ranks if r.status == 200]
    return {**lat, "meets_slo": bool(lat["p99_ms"] <= slo_ms),
            "errors_by_kind": {k: v for k, v in sorted(kinds.items()) if k != "ok"},
            "cache": dict(sorted(cache.items())),
            "hit_rate": (cache.get("device", 0) + cache.get("dram", 0)) / ok if ok else None,
            "offered_qps": len(ranks) / span if span > 0 else None,
            "served_qps": ok / span if span > 0 else None,
            "p99_ms_served": float(np.percentile(served, 99, method="higher")) if served else None,
            "p99_ms_shed": float(np.percentile(shed, 99, method="higher")) if shed else None,
            "truncated_tokens": sum(r.payload.get("truncated", 0) for r in ranks if r.status == 200 and r.payload),
            **early}


def gc_over(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """:func:`gc_summary` over a point's repeats: counts summed, the longest pause the longest of any."""
    found = [r["gc_pauses"] for r in runs if r.get("gc_pauses")]
    if not found:
        return None
    out: dict[str, Any] = {}
    for side in ("rankers", "harness"):
        keys = found[0][side]
        out[side] = {k: (max(f[side][k] for f in found) if k == "max_ms" else sum(f[side][k] for f in found))
                     for k in keys}
    return out


def combine(runs: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """A point over its repeats: P99 is the median of the repeats' (pass/fail by it), with min and max."""
    import numpy as np

    p99 = [r["p99_ms"] for r in runs]
    med = float(np.median(p99))
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r["errors_by_kind"])
    answered = sum(sum(r["cache"].values()) for r in runs)
    hits = sum(r["cache"].get("device", 0) + r["cache"].get("dram", 0) for r in runs)
    last = runs[-1]
    keys = ("prefill_tokens_computed", "prefill_tokens_without_incremental", "joined_inflight_ranks")
    sums = {k: (None if any(r[k] is None for r in runs) else sum(r[k] for r in runs)) for k in keys}
    shares = [r["prefill_cpu_share"] for r in runs if r["prefill_cpu_share"] is not None]
    per_visit = [r["compute_ms_per_visit"] for r in runs if r.get("compute_ms_per_visit") is not None]
    decisions: Counter[str] = Counter()
    for r in runs:
        decisions.update(r.get("trigger_decisions", {}))
    # what cross-visit reuse alone could serve of the trace (serve_trace.reuse_flags), beside the hit rate
    reuse = [r["trace"]["reuse_share"] for r in runs if (r.get("trace") or {}).get("reuse_share") is not None]
    return {"n": sum(r["n"] for r in runs), "planned": sum(r["planned"] for r in runs),
            "stopped_early": any(r["stopped_early"] for r in runs),
            "p50_ms": float(np.median([r["p50_ms"] for r in runs])),
            "p99_ms": med, "p99_ms_min": float(min(p99)), "p99_ms_max": float(max(p99)),
            "meets_slo": bool(med <= slo_ms), "errors": sum(errors.values()), "errors_by_kind": dict(errors),
            "hit_rate": hits / answered if answered else None, **sums,
            "prefill_cpu_share": float(np.mean(shares)) if shares else None,
            "compute_ms_per_visit": float(np.median(per_visit)) if per_visit else None,
            "trigger_decisions": dict(sorted(decisions.items())),
            "reuse_share": float(np.mean(reuse)) if reuse else None,
            "host_cpu": host_cpu.mean_usage([r["host_cpu"] for r in runs if r.get("host_cpu")]),
            "gc_pauses": gc_over(runs),
            "device_bytes": last["device_bytes"], "dram_bytes": last["dram_bytes"], "repeats": runs}


@dataclass
class ModeRun:
    mode: str
    router_url: str
    ranker_urls: list[str]
    session: Any
    settings: Settings
    kept: list[dict[str, Any]]
    t0: float
    ranker_pids: tuple[int, ...] = ()  # this mode's rankers
    idle_pids: tuple[int, ...] = ()  # the other modes' rankers, idle while this mode is measured
    step_log: list[dict[str, Any]] | None = None  # where each repeat's logged steps go (None: not read)
    since: dict[str, tuple[int, int]] = field(default_factory=dict)  # per ranker: the step log read so far


# A repeat's logged steps as columns (runtime/serve/step_log.py's fields; what a cost profile is judged on)
STEP_COLUMNS = ("kind", "batch", "tokens", "context", "pairs", "cold", "seconds", "cpu_seconds")


def step_columns(steps: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {c: [s.get(c) for s in steps] for c in STEP_COLUMNS}


def step_rows(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """:func:`step_columns` back to records."""
    n = len(columns.get("kind", []))
    return [{c: columns[c][i] for c in STEP_COLUMNS if c in columns} for i in range(n)]


async def read_step_log(session: Any, url: str, since: tuple[int, int]) -> tuple[dict[str, Any], tuple[int, int]]:
    """A ranker's ``GET /v1/steps`` above ``since`` (steps, requests) and the counters to pass next time."""
    async with session.get(url + "/v1/steps", params={"since": str(since[0]),
                                                      "requests_since": str(since[1])}) as resp:
        resp.raise_for_status()
        got = await resp.json()
    if got["steps_dropped"] or got["requests_dropped"]:
        _log(f"{url}: {got['steps_dropped']} steps and {got['requests_dropped']} requests were overwritten before "
             f"they were read (the ring holds {got['capacity']})")
    return got, (got["next_since"], got["next_requests_since"])


async def _record_steps(m: ModeRun, sweep: str, length: int, qps: float, repeat: int) -> None:
    """Appends what ``m``'s rankers computed since the last read to ``m.step_log`` (the held-out run's own
    step costs: what a simulator's validation measures the host's speed on)."""
    if m.step_log is None:
        return
    steps: list[dict[str, Any]] = []
    for url in m.ranker_urls:
        got, m.since[url] = await read_step_log(m.session, url, m.since.get(url, (0, 0)))
        steps += got["steps"]
    m.step_log.append({"mode": m.mode, "sweep": sweep, "length": length, "qps": qps, "repeat": repeat,
                       "steps": step_columns(steps)})


async def measure_once(m: ModeRun, sweep: str, length: int, qps: float, repeat: int,
                       results_out: list[Any] | None = None, whole: bool = False) -> dict[str, Any]:
    """One run of a point's trace; ``results_out``: where the load generator's results are added; ``whole``:
    send all of it even once its P99 is certain to miss the SLO (a calibration wants every step)."""
    from grstack.runtime.serve import (
        GiveUp,
        frozen_heap,
        recorded_gc_pauses,
        run_open_loop,
        violations_to_fail,
    )

    s = m.settings
    trace = s.trace(length, qps, repeat)
    reqs, visit_of = encode(trace, f"{m.mode}-{sweep}-L{length}-q{qps:g}-r{repeat}")
    planned = sum(r.measure for r in reqs)
    # A sweep point stops sending once its P99 is certain to miss the SLO (the overload run is sent whole:
    # it measures what is served and shed, not a pass/fail).
    give_up = None if sweep == "overload" or whole else GiveUp(s.slo_ms, violations_to_fail(planned))
    before = await _ranker_state(m.session, m.ranker_urls)
    decided = await _trigger_counts(m.session, m.router_url)
    gc0 = await _ranker_gc(m.session, m.ranker_urls)
    cpu0 = host_cpu.take((*m.ranker_pids, *m.idle_pids))
    # This process is the load generator and the router: the trace just built, the population and every
    # earlier point's results would make each full collection during the run a 130-140 ms stop of both.
    with frozen_heap(), recorded_gc_pauses() as pauses:
        results = await run_open_loop(m.router_url, reqs, timeout_s=s.timeout_s, session=m.session,
                                      deadline_ms=s.slo_ms, give_up=give_up)
        await _drain(m.session, m.ranker_urls)
    cpu = host_cpu.usage(cpu0, host_cpu.take((*m.ranker_pids, *m.idle_pids)),
                         {"rankers": m.ranker_pids, "idle_rankers": m.idle_pids})
    gc_pauses = gc_summary(gc0, await _ranker_gc(m.session, m.ranker_urls), pauses)
    after = await _ranker_state(m.session, m.ranker_urls)
    decisions = trigger_deltas(decided, await _trigger_counts(m.session, m.router_url))
    await _record_steps(m, sweep, length, qps, repeat)
    visits = sum(r.request.path == "/v1/rank" for r in results)
    if results_out is not None:
        results_out.extend(results)
    out = {"trace_seed": s.seed + repeat, **summarize(results, s.slo_ms, planned),
           **state_deltas(before, after, visits), "trigger_decisions": decisions, "host_cpu": cpu, "gc_pauses": gc_pauses,
           "trace": trace.shape}
    if m.mode in ("relay", "no_trigger"):
        keep_for_score_check(m.kept, m.mode, trace, visit_of, results)
    return out


def keep_for_score_check(kept: list[dict[str, Any]], mode: str, trace: Trace, visit_of: dict[int, int],
                         results: list[Any]) -> None:
    """Up to SCORE_SAMPLES_PER_POINT cache hits of this point, visits after a history grew first. The relay
    mode's come first; no_trigger's (every prefix pre-inferred) only top them up to SCORE_SAMPLES_MIN."""
    room = SCORE_SAMPLES_MAX - len(kept)
    if mode != "relay":
        room = min(room, SCORE_SAMPLES_MIN - len(kept))
    hits = [(trace.visits[visit_of[id(r.request)]], r) for r in results
            if id(r.request) in visit_of and r.status == 200 and r.payload
            and r.payload.get("cache") in ("device", "dram")]
    hits.sort(key=lambda vr: not vr[0].grew)
    for v, r in hits[:max(0, min(SCORE_SAMPLES_PER_POINT, room))]:
        kept.append({"mode": mode, "long_items": v.long_items, "long_ts": v.long_ts, "short_items": v.short_items,
                     "short_ts": v.short_ts, "candidates": v.candidates, "timestamp": int(v.t), "grew": bool(v.grew),
                     "scores": r.payload["scores"]})


async def _drain(session: Any, urls: list[str], limit_s: float = 60.0) -> None:
    """Waits until no ranker has queued work (prefills signalled near the end still run)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        state = await _ranker_state(session, urls)
        if all(s.get("queued", 0) == 0 for s in state):
            return
        await asyncio.sleep(0.1)


async def measure_step(runs: dict[str, ModeRun], order: list[str], sweep: str, length: int,
                       qps: float) -> dict[str, dict[str, Any]]:
    """One sweep value for the modes in ``order``: their repeats in :func:`repeat_order`, then each mode's point."""
    reps: dict[str, list[dict[str, Any]]] = {m: [] for m in order}
    started: dict[str, float] = {}
    repeats = next(iter(runs.values())).settings.repeats
    for mode, rep in repeat_order(order, repeats):
        m = runs[mode]
        started.setdefault(mode, time.monotonic() - m.t0)
        run = await measure_once(m, sweep, length, qps, rep)
        reps[mode].append(run)
        if repeats > 1:  # the point's line comes after every mode's last repeat: show progress meanwhile
            _log(f"{mode:11s} {sweep:6s} length={length:5d} qps={qps:6.1f} repeat {rep + 1}/{repeats}: "
                 f"p99={run['p99_ms']:8.1f} ms elapsed={time.monotonic() - m.t0:6.0f} s")
    return {mode: point_from(runs[mode], sweep, length, qps, reps[mode], started[mode]) for mode in order}


def point_from(m: ModeRun, sweep: str, length: int, qps: float, runs: list[dict[str, Any]],
               started: float) -> dict[str, Any]:
    p = {"sweep": sweep, "length": length, "qps": qps, "started_s": round(started, 1),
         **combine(runs, m.settings.slo_ms)}
    hr = "-" if p["hit_rate"] is None else f"{p['hit_rate']:.2f}"
    sent = f" (gave up: P99 above the SLO after {p['n']} of {p['planned']})" if p["stopped_early"] else ""
    c = p["host_cpu"]
    cpu = "" if not c or c.get("busy") is None else (
        f" cpu={c['busy']:.2f}/{c['cores']} (harness {c['harness']:.2f}, rankers {c['rankers']:.2f}, "
        f"other {c['other']:.2f})")
    g = p["gc_pauses"]
    if g:
        cpu += (f" gc>50ms rankers {g['rankers']['over_50ms']} harness {g['harness']['over_50ms']} "
                f"(longest here {g['harness']['max_ms']} ms)")
    _log(f"{m.mode:11s} {sweep:6s} length={length:5d} qps={qps:6.1f} n={p['n']:5d}{sent} p50={p['p50_ms']:8.1f} ms "
         f"p99={p['p99_ms']:8.1f} ms errors={p['errors_by_kind'] or 0} hit_rate={hr} "
         f"{cpu} elapsed={time.monotonic() - m.t0:6.0f} s")
    return p


def ranker_args(mode: str) -> list[str]:
    """The baseline ranks every visit by full inference: its rankers keep no prefix at all, not even the ones
    their misses computed (which the other modes cache for the user's next visits). prefix_cache's keep what
    their ranks computed, on the device tier only (an LLM server's automatic prefix cache); no_expander's too."""
    dram = 0 if mode in ("no_expander", "prefix_cache") else DRAM_CACHE_MB
    return ["--device", "cpu", "--threads", "1", "--max-suffix", str(MAX_SUFFIX), "--max-candidates",
            str(CANDIDATES), "--device-cache-mb", str(DEVICE_CACHE_MB), "--dram-cache-mb", str(dram),
            "--dram-ttl-s", f"{DRAM_TTL_S:g}", *(["--no-cache-misses"] if mode == "baseline" else []),
            "--log-level", "WARNING"]


def router_config(mode: str, urls: list[str], slo_ms: float) -> Any:
    from grstack.runtime.serve import RouterConfig, TriggerConfig

    # the baselines ignore the retrieval signal: nothing is pre-inferred (prefix_cache still routes by affinity,
    # as a prefix-aware LLM router does, so a user's next rank finds what her last one left)
    return RouterConfig(rankers=tuple(urls), relay=mode not in BASELINES, affinity=mode != "no_affinity",
                        trigger=TriggerConfig(slo_ms=slo_ms, admit_all=mode == "no_trigger"),
                        rank_budget_ms=slo_ms, prefill_budget_per_replica_ms=500.0)


@asynccontextmanager
async def mode_runs(modes: tuple[str, ...], checkpoint: Path, s: Settings, kept: list[dict[str, Any]],
                    t0: float, step_log: list[dict[str, Any]] | None = None) -> AsyncIterator[dict[str, ModeRun]]:
    """Fresh rankers and a router for each of ``modes``, started together and kept for the whole sweep: the
    points run interleaved across modes (:func:`run_sweeps`), and each mode's rankers see only its own points,
    in its own order, as when the modes ran one after another. Idle rankers cost nothing but memory.
    ``step_log``: where each measured repeat's steps are appended (start-up's are skipped)."""
    import aiohttp

    from grstack.runtime.serve import Router, spawn_ranker, start_router

    gate = asyncio.Semaphore(s.rankers)

    async def spawn(mode: str) -> Any:
        async with gate:
            return await spawn_ranker(checkpoint, ranker_args(mode), nice=RANKER_NICE, cpus=s.ranker_cpus)

    started = await asyncio.gather(*(spawn(mode) for mode in modes for _ in range(s.rankers)),
                                   return_exceptions=True)
    rankers = [r for r in started if not isinstance(r, BaseException)]
    runners: list[Any] = []
    try:
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4096)) as session:
            runs = {}
            for i, mode in enumerate(modes):
                own = rankers[i * s.rankers:(i + 1) * s.rankers]
                urls = [r.url for r in own]
                runner, url = await start_router(Router(router_config(mode, urls, s.slo_ms)))
                runners.append(runner)
                runs[mode] = ModeRun(mode, url, urls, session, s, kept, t0,
                                     ranker_pids=tuple(r.pid for r in own),
                                     idle_pids=tuple(r.pid for r in rankers if r not in own), step_log=step_log)
                if step_log is not None:  # start-up (warm-up, profile) is not service
                    for u in urls:
                        _, runs[mode].since[u] = await read_step_log(session, u, (0, 0))
            yield runs
    finally:
        for runner in runners:
            await runner.cleanup()
        await asyncio.gather(*(r.stop() for r in rankers), return_exceptions=True)


async def sweep_modes(runs: dict[str, ModeRun]) -> dict[str, dict[str, Any]]:
    """The length sweep, then the QPS sweep, of every mode, interleaved (:func:`run_sweeps`)."""
    s = next(iter(runs.values())).settings
    modes = list(runs)
    lengths = await run_sweeps(modes, [float(x) for x in s.lengths],
                               lambda order, v: measure_step(runs, order, "length", int(v), s.length_qps))

    async def qps_step(order: list[str], v: float) -> dict[str, dict[str, Any]]:
        # The length sweep's point at the QPS sweep's length and QPS ran the very same trace (same seeds):
        # it is that point, not measured twice.
        out = {}
        for mode in order:
            same = next((p for p in lengths[mode] if (p["length"], p["qps"]) == (s.qps_length, v)), None)
            if same is not None:
                _log(f"{mode:11s} qps    length={s.qps_length:5d} qps={v:6.1f}: the length sweep's point (same "
                     f"trace)")
                out[mode] = {**same, "sweep": "qps", "shared_with": "length"}
        rest = [mode for mode in order if mode not in out]
        if rest:
            out.update(await measure_step(runs, rest, "qps", s.qps_length, v))
        return out

    qps = await run_sweeps(modes, s.qps, qps_step, floor=s.qps_floor)
    out = {}
    for mode in modes:
        out[mode] = {"points": lengths[mode] + qps[mode], "max_len_at_slo": sweep_limit(lengths[mode], "length"),
                     "max_qps_at_slo": sweep_limit(qps[mode], "qps")}
        for key, swept, vals in (("length", lengths[mode], s.lengths), ("QPS", qps[mode], s.qps)):
            if len(swept) >= len(vals) and all(p["meets_slo"] for p in swept):
                _log(f"{mode} met the SLO at every swept {key}: its limit is a lower bound")
    return out


async def overload(m: ModeRun, offered: float) -> dict[str, Any]:
    s = m.settings
    runs = [await measure_once(m, "overload", s.qps_length, offered, 0)]
    r = runs[0]
    shed = sum(v for k, v in r["errors_by_kind"].items() if k.startswith("shed"))
    other = sum(v for k, v in r["errors_by_kind"].items() if not k.startswith("shed"))
    out = {"offered_qps": r["offered_qps"], "target_qps": offered, "served_qps": r["served_qps"],
           "shed_fraction": shed / r["n"] if r["n"] else None, "p99_ms_served": r["p99_ms_served"],
           "p99_ms_shed": r["p99_ms_shed"], "errors_other": other, "errors_by_kind": r["errors_by_kind"],
           "length": s.qps_length, "n": r["n"], "host_cpu": r["host_cpu"], "gc_pauses": r["gc_pauses"]}
    _log(f"overload   relay at {offered:g} QPS: served {r['served_qps'] or 0:.1f} QPS, shed {out['shed_fraction']}, "
         f"P99 served {r['p99_ms_served']}, other errors {other}")
    return out


def score_diff(checkpoint: Path, kept: list[dict[str, Any]]) -> float | None:
    """Largest |relay score - full inference| over the kept cache hits, recomputed in fp32 here."""
    import numpy as np

    from grstack.runtime.serve import RelayEngine, load_ranking_model

    if not kept:
        return None
    model, _ = load_ranking_model(checkpoint)
    eng = RelayEngine(model, max_suffix=MAX_SUFFIX)
    worst = 0.0
    for k in kept:
        item = eng.canonical(k["long_items"], k["long_ts"], k["short_items"], k["short_ts"], k["candidates"],
                             k["timestamp"])
        ref = eng.rank_encode([item])[0].numpy()
        worst = max(worst, float(np.abs(ref - np.asarray(k["scores"], dtype=np.float32)).max()))
    return worst


PLOT_STYLES = ("o-", "x-", "s-", "^--", "v--", "d--")  # one per mode, baseline first


def capped_ms(ms: float | None, cap: float = 1e4) -> float:
    """A P99 for a log-scale plot: a failure (None, or an infinite P99) drawn at ``cap``."""
    return cap if ms is None else min(ms, cap)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = {m: result[m] for m in (*BASELINES, "relay") if m in result} | result["ablations"]
    for (mode, res), style in zip(modes.items(), PLOT_STYLES, strict=False):
        for ax, sweep, key in ((axes[0], "length", "length"), (axes[1], "qps", "qps")):
            pts = sorted((p for p in res["points"] if p["sweep"] == sweep), key=lambda p: p[key])
            ax.plot([p[key] for p in pts], [capped_ms(p["p99_ms"]) for p in pts], style, label=mode)
    for ax, xlabel in ((axes[0], "base long-term length (events)"), (axes[1], "offered load (QPS)")):
        ax.axhline(result["slo_ms"], color="gray", linestyle=":", label=f"SLO {result['slo_ms']:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("P99 rank latency (ms; failures at 1e4)")
        ax.legend(fontsize=8)
    axes[0].set_title("P99 vs length")
    axes[1].set_title("P99 vs QPS")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _relay_totals(res: dict[str, Any]) -> dict[str, Any]:
    pts = res["points"]
    answered = [(p["hit_rate"], p["n"]) for p in pts if p["hit_rate"] is not None]
    shares = [p["prefill_cpu_share"] for p in pts if p["prefill_cpu_share"] is not None]
    reuse = [(p["reuse_share"], p["n"]) for p in pts if p.get("reuse_share") is not None]
    return {"hit_rate": (sum(h * n for h, n in answered) / sum(n for _, n in answered)) if answered else None,
            "reuse_share": (sum(r * n for r, n in reuse) / sum(n for _, n in reuse)) if reuse else None,
            "prefill_cpu_share": sum(shares) / len(shares) if shares else None,
            "device_bytes": pts[-1]["device_bytes"] if pts else None,
            "dram_bytes": pts[-1]["dram_bytes"] if pts else None}


def capacity(points: list[dict[str, Any]], rankers: int) -> dict[str, Any]:
    """The QPS the rankers could serve at all at the QPS sweep's length: ``rankers`` one-thread compute loops
    over the median measured compute per visit of that sweep's points (warm-up included). No scheduling
    serves more than this, so it bounds the mode's ``max_qps_at_slo`` from above, SLO or not."""
    per_visit = sorted(p["compute_ms_per_visit"] for p in points
                       if p["sweep"] == "qps" and p.get("compute_ms_per_visit"))
    if not per_visit:
        return {"compute_ms_per_visit": None, "ceiling_qps": None}
    mid = len(per_visit) // 2
    med = per_visit[mid] if len(per_visit) % 2 else (per_visit[mid - 1] + per_visit[mid]) / 2
    return {"compute_ms_per_visit": med, "ceiling_qps": rankers * 1000.0 / med}


def _tokens(pts: list[dict[str, Any]], key: str) -> float | None:
    vals = [p[key] for p in pts]
    return None if not vals or any(v is None for v in vals) else sum(vals)


async def host_load(seconds: float = 3.0) -> dict[str, Any]:
    """The host's CPU use before anything of the benchmark runs: what else shares these cores."""
    before = host_cpu.take()
    await asyncio.sleep(seconds)
    load = host_cpu.usage(before, host_cpu.take(), {})
    if (load.get("other") or 0.0) > HOST_BUSY_WARN:
        _log(f"warning: other processes use {load['other']:.2f} of {load['cores']} cores before the benchmark "
             f"starts; its figures measure a shared host (host_cpu in each point says how shared)")
    return load


def write_model(s: Settings) -> tuple[Path, int, list[Trace]]:
    """The benchmark's model (untrained, long enough for the longest history a point's trace sends), its
    max_len, and the first trace of each repeat."""
    from grstack.runtime.serve import write_untrained_model

    probe = [s.trace(s.qps_length, s.length_qps, rep) for rep in range(s.repeats)]
    # users' bases are heterogeneous (a multiple of the length) and which users visit depends on the QPS: the
    # bound covers any visit of the population at the longest length
    longest = max(*s.lengths, s.qps_length)
    bound = max(max_long_bound(s.population(rep), s.trace_config(longest, s.length_qps, rep))
                for rep in range(s.repeats))
    growth = bound - longest
    max_len = bound + MAX_SUFFIX
    checkpoint = write_untrained_model(s.out / "model.pt", num_items=probe[0].num_items, max_len=max_len,
                                       seed=s.seed)
    _log(f"model: untrained HSTU (d=64, 2 blocks, 2 heads), max_len {max_len} (longest length {longest}, heavier users' "
         f"bases and growth {growth} "
         f"+ {MAX_SUFFIX}); trace: {probe[0].shape}")
    return checkpoint, max_len, probe


def warn_pressure(shape: dict[str, Any]) -> None:
    """Logs a trace whose visited users' prefixes fall short of the protocol's cache pressure."""
    got, want = shape.get("cache_pressure"), shape.get("cache_pressure_target")
    if got is not None and want is not None and got < want:
        _log(f"warning: the visited users' prefixes need {got:.1f}x the rankers' device tiers, below the "
             f"protocol's {want:g}x: the population ({shape['population_users']} users) is too small for it")


async def bench(s: Settings, step_log: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The sweeps, the overload run and the score check; ``step_log`` receives the sweeps' logged steps."""
    t0 = time.monotonic()
    if s.harness_cpus is not None:
        threads = cpu_pinning.pin_this_process(s.harness_cpus)
        _log(f"harness (load generator and routers, {threads} threads) pinned to CPUs "
             f"{cpu_pinning.format_cpus(s.harness_cpus)}")
    if s.ranker_cpus is not None:
        _log(f"rankers pinned to CPUs {cpu_pinning.format_cpus(s.ranker_cpus)}")
    idle = await host_load()
    checkpoint, max_len, probe = write_model(s)
    warn_pressure(probe[0].shape)
    kept: list[dict[str, Any]] = []
    _log(f"starting {len(s.modes)} x {s.rankers} rankers (every mode's, kept for both sweeps; points run interleaved "
         f"across modes); about {s.total_seconds() / 60:.1f} min if every swept point runs (sweeps stop at their "
         f"first failure)")
    async with mode_runs(s.modes, checkpoint, s, kept, t0, step_log) as runs:
        modes = await sweep_modes(runs)
    base_qps = modes["baseline"]["max_qps_at_slo"]
    offered = 3.0 * (base_qps if base_qps is not None else min(s.qps))
    async with mode_runs(("relay",), checkpoint, s, kept, t0) as fresh:
        over = await overload(fresh["relay"], offered)
    _log(f"checking {len(kept)} cache hits ({sum(1 for k in kept if k['grew'])} after a history grew) "
         f"against full inference")
    diff = score_diff(checkpoint, kept)
    result: dict[str, Any] = {"slo_ms": s.slo_ms,
                              "protocol": {"users": s.users, "measured_requests_min": s.measured,
                                           "repeats": s.repeats, "cascade_gap_ms": s.gap_ms, "cascade_jitter": 0.2,
                                           "prefill_on_clock": True, "preload": False, "slo_ms": s.slo_ms,
                                           "rankers": s.rankers, "ranker_nice": RANKER_NICE,
                                           "ranker_cpus": _cpus(s.ranker_cpus),
                                           "harness_cpus": _cpus(s.harness_cpus),
                                           "schedule": "interleaved", "trace": s.trace_kind,
                                           "warmup_visits": s.warmup,
                                           "lengths": s.lengths, "length_qps": s.length_qps, "qps": s.qps,
                                           "qps_length": s.qps_length, "qps_floor": s.qps_floor, "max_len": max_len,
                                           "device_cache_mb": DEVICE_CACHE_MB, "dram_cache_mb": DRAM_CACHE_MB,
                                           "dram_ttl_s": DRAM_TTL_S, "follow_through": FOLLOW_THROUGH,
                                           "cache_pressure_target": CACHE_PRESSURE,
                                           "kv_bytes_per_token": KV_BYTES_PER_TOKEN}}
    base = modes["baseline"]
    result["baseline"] = base
    if "prefix_cache" in modes:
        result["prefix_cache"] = modes["prefix_cache"]
    result["relay"] = {**modes["relay"], **_relay_totals(modes["relay"])}
    # relay against full inference (also the top-level ratios, as before) and against prefix caching alone
    result["relay_vs_full"] = versus(result["relay"], base)
    result["relay_vs_prefix_cache"] = (versus(result["relay"], modes["prefix_cache"]) if "prefix_cache" in modes
                                       else None)
    result.update(result["relay_vs_full"])
    result["ablations"] = {a: {**modes[a], **versus(modes[a], base)} for a in ABLATIONS if a in modes}
    rp = modes["relay"]["points"]
    result["prefill_tokens"] = {"computed": _tokens(rp, "prefill_tokens_computed"),
                                "without_incremental": _tokens(rp, "prefill_tokens_without_incremental")}
    caps = {m: capacity(modes[m]["points"], s.rankers) for m in ("baseline", "relay")}
    relay_ceiling = caps["relay"]["ceiling_qps"]
    # the largest slo_qps_ratio relay could show against this baseline on these cores, at 100% utilisation
    caps["slo_qps_ratio_bound"] = ratio(relay_ceiling, base["max_qps_at_slo"]) if relay_ceiling else None
    result["capacity"] = caps
    result["overload"] = over
    result["max_abs_score_diff"] = diff
    result["score_diff_samples"] = {"n": len(kept), "after_growth": sum(1 for k in kept if k["grew"]),
                                    "by_mode": dict(Counter(k["mode"] for k in kept))}
    if len(kept) < SCORE_SAMPLES_MIN:
        _log(f"only {len(kept)} cache hits to check against full inference (the protocol wants "
             f"{SCORE_SAMPLES_MIN})")
    result["trace"] = probe[0].shape
    result["host_cpu_before"] = idle
    return result


STEP_LOG_FILE = "serve-bench-steps.json.gz"  # every sweep repeat's logged steps, beside serve-bench.json


def write_step_log(path: Path, repeats: list[dict[str, Any]]) -> Path:
    """The sweeps' step logs (:func:`_record_steps`), gzipped JSON: a simulator validated on this run measures
    the host's speed during it from them (docs/serve-simulator.md)."""
    import gzip

    path.write_bytes(gzip.compress(json.dumps({"version": 1, "repeats": _json_safe(repeats)}).encode(), mtime=0))
    return path


def read_step_log_file(path: Path) -> list[dict[str, Any]]:
    import gzip

    d = json.loads(gzip.decompress(path.read_bytes()))
    if d.get("version") != 1:
        raise ValueError(f"{path}: step log version {d.get('version')}; this grstack reads version 1")
    return list(d["repeats"])


def _cpus(cpus: frozenset[int] | None) -> str | None:
    return cpu_pinning.format_cpus(cpus) if cpus is not None else None


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    """The printed object: everything but the per-repeat details (those stay in the file)."""
    def strip(res: dict[str, Any]) -> dict[str, Any]:
        return {**res, "points": [{k: v for k, v in p.items() if k != "repeats"} for p in res["points"]]}

    out = {**result, **{m: strip(result[m]) for m in (*BASELINES, "relay") if m in result}}
    out["ablations"] = {k: strip(v) for k, v in result["ablations"].items()}
    return out


def settings_from(args: argparse.Namespace) -> Settings:
    from grstack.runtime.errors import UserError

    preset = QUICK if args.quick else FULL

    def floats(flag: str, text: str | None, default: list[float]) -> list[float]:
        if text is None:
            return list(default)
        try:
            vals = sorted(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
        if not vals or min(vals) <= 0:
            raise UserError(f"{flag}: values must be positive, got {text!r}")
        return vals

    s = Settings(users=args.users or preset["users"],
                 lengths=[int(x) for x in floats("--lengths", args.lengths, preset["lengths"])],
                 length_qps=args.length_qps or preset["length_qps"], qps=floats("--qps", args.qps, preset["qps"]),
                 qps_length=args.qps_length or preset["qps_length"], repeats=args.repeats or preset["repeats"],
                 slo_ms=args.slo_ms, gap_ms=args.cascade_gap_ms,
                 measured=1000 if args.measured is None else args.measured,
                 warmup=250 if args.warmup is None else args.warmup,
                 seed=args.seed, out=Path(args.out),
                 qps_floor=args.qps_floor or preset["qps_floor"], min_user_gap_s=args.min_user_gap_s,
                 rankers=args.rankers, trace_kind=args.trace,
                 ranker_cpus=cpu_pinning.parse_cpus("--ranker-cpus", args.ranker_cpus) if args.ranker_cpus else None,
                 harness_cpus=(cpu_pinning.parse_cpus("--harness-cpus", args.harness_cpus)
                               if args.harness_cpus else None))
    checks = (("--users", s.users >= 1), ("--slo-ms", s.slo_ms > 0), ("--cascade-gap-ms", s.gap_ms >= 0),
              ("--length-qps", s.length_qps > 0), ("--qps-length", s.qps_length >= 1),
              ("--repeats", s.repeats >= 1), ("--measured", s.measured >= 1), ("--warmup", s.warmup >= 0),
              ("--lengths", min(s.lengths) >= 1), ("--qps-floor", s.qps_floor > 0),
              ("--min-user-gap-s", s.min_user_gap_s >= 0), ("--rankers", s.rankers >= 1))
    for flag, ok in checks:
        if not ok:
            raise UserError(f"{flag}: must be positive (--warmup and --cascade-gap-ms may be 0)")
    if args.modes is not None:
        chosen = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        unknown = [m for m in chosen if m not in MODES]
        if unknown:
            raise UserError(f"--modes: unknown mode {unknown[0]!r} (one of {', '.join(MODES)})")
        s = replace(s, modes=tuple(m for m in MODES if m in {*chosen, "baseline", "relay"}))
    if max(*s.lengths, s.qps_length) > MAX_LENGTH:
        raise UserError(f"--lengths/--qps-length: at most {MAX_LENGTH} events (a request carries at most 100,000 "
                        f"with the growth)")
    return s


def run(args: argparse.Namespace) -> int:
    if args.simulate:
        from grstack.runtime.bench.serve_simulate import run_simulate

        return run_simulate(args)
    if args.calibrate is not None:
        from grstack.runtime.bench.serve_calibrate import run_calibrate

        return run_calibrate(args)
    s = settings_from(args)
    if s.measured < 1000:
        _log(f"--measured {s.measured}: below the protocol's 1,000 measured ranks per point (a smoke run)")
    _log(f"P99 SLO {s.slo_ms:g} ms; {s.users} users, {s.warmup} warm-up visits + {s.measured} measured ranks per "
         f"point, {s.repeats} repeat(s), cascade gap {s.gap_ms:g} ms; estimate {s.total_seconds() / 60:.1f} min if "
         f"every swept point of every mode runs, {s.total_seconds(probe=True) / 60:.1f} min if every mode also "
         f"fails the lowest QPS and is probed down to {s.qps_floor:g}")
    t0 = time.perf_counter()
    steps: list[dict[str, Any]] = []
    result = _json_safe(asyncio.run(bench(s, steps)))
    png = s.out / "serve-p99.png"
    plot(result, png)
    details = {**result, "plot": str(png), "seconds": round(time.perf_counter() - t0, 1)}
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / "serve-bench.json").write_text(json.dumps(details, indent=2))
    write_step_log(s.out / STEP_LOG_FILE, steps)
    if not args.json:
        r, b = result["relay"], result["baseline"]
        _log(f"P99 SLO {s.slo_ms:g} ms: max length {b['max_len_at_slo']} -> {r['max_len_at_slo']} "
             f"(x{result['max_len_ratio']}), max QPS {b['max_qps_at_slo']} -> {r['max_qps_at_slo']} "
             f"(x{result['slo_qps_ratio']}); max |score diff| {result['max_abs_score_diff']}; plot {png}; "
             f"{details['seconds']} s")
    print(json.dumps(_brief(result)))
    return 0

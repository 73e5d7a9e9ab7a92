"""The training engine side by side with an earlier commit's: step time, the time the training thread was
blocked on communication and the exposed-communication ratio of every pipeline mode, on 2 local gloo ranks.

    python -P bench/train_ab.py --ref 31d90eb --runs 7 --out docs/results/train-ab.json

Both engines run ``grstack bench train``'s quick configuration and modes through their own
``harness.run_modes``, alternating run by run so that both see the same machine load, in counterbalanced
order (ref then head in even runs, head then ref in odd ones: a fixed order would give one side the same
position every time). Each run times ``--steps`` steps of every mode
after ``--warmup``. The figures are read from outside both engines, the same way for each: at the end of
every step (``CommClock.measure``) the training thread's blocked intervals (every wait for communication,
and collectives it ran itself) and the step's communication events.

Per run, engine and mode: ``step_ms`` and ``blocked_ms`` (medians over the timed steps); ``exposed_ratio``
(the engine's own definition: the summed overlap of each event with the blocked intervals over the summed
event length, events in flight together each counting); ``exposed_union_ratio`` (the union of the events'
intervals that the blocked intervals cover, over that union: each moment of communication counted once).
Per mode and metric the summary gives the geometric mean of the paired head/ref ratios over the runs with a
95 % bootstrap interval (10,000 resamples of the runs, seed 0); "no worse" reads: the interval does not lie
wholly above 1.

The ref commit is installed once into a temporary folder (``pip install --no-deps --target``) and put first
on the ranks' ``PYTHONPATH``; head is the working tree. Progress goes to stderr, the JSON to ``--out`` and
stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
METRICS = ("step_ms", "blocked_ms", "exposed_ratio", "exposed_union_ratio")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (each moment once)."""
    return sum((b - a for a, b in _merge(intervals)), 0.0)


def covered(events: list[tuple[float, float]], blocked: list[tuple[float, float]]) -> float:
    """Length of the union of ``events`` that the union of ``blocked`` also covers."""
    ev = _merge(events)
    bl = _merge(blocked)
    out, j = 0.0, 0
    for a, b in ev:
        while j < len(bl) and bl[j][1] <= a:
            j += 1
        k = j
        while k < len(bl) and bl[k][0] < b:
            out += max(0.0, min(b, bl[k][1]) - max(a, bl[k][0]))
            k += 1
    return out


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def timed(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One rank (run by ``call_ranks`` in the engine under test): ``harness.run_modes`` with every step's
    blocked intervals and events read at ``CommClock.measure``. Returns {mode: [per-step dicts]}."""
    import threading

    from grstack.runtime.train import harness, timing

    steps: list[dict[str, float]] = []
    original = timing.CommClock.measure

    def measure(self: Any, start: float, end: float) -> tuple[float, float]:
        with self._lock:
            events = [*self._done, *((t0, end) for t0 in self._running.values())]
        clip = [(max(a, start), min(b, end)) for a, b in events]
        clip = [(a, b) for a, b in clip if b > a]
        blocked = [(max(a, start), min(b, end)) for a, b in self._blocked]
        blocked = [(a, b) for a, b in blocked if b > a]
        comm, exposed = original(self, start, end)
        steps.append({"step_ms": 1e3 * (end - start), "blocked_ms": 1e3 * sum(b - a for a, b in blocked),
                      "comm_ms": 1e3 * comm, "exposed_ms": 1e3 * exposed,
                      "union_ms": 1e3 * union_length(clip), "union_exposed_ms": 1e3 * covered(clip, blocked),
                      "thread": threading.current_thread().name})
        return comm, exposed

    timing.CommClock.measure = measure  # type: ignore[method-assign]
    harness.run_modes(env, {**payload, "params": False})  # the modes one after another, each ``steps`` steps
    n = payload["steps"]
    if len(steps) != n * len(payload["modes"]):
        raise RuntimeError(f"{len(steps)} measured steps, expected {n} for each of {len(payload['modes'])} modes")
    return {name: steps[i * n : (i + 1) * n] for i, name in enumerate(payload["modes"])}


def _engine_run(pythonpath: str, payload: dict[str, Any], result: Path) -> None:
    """Runs ``timed`` on 2 ranks of the engine first on ``pythonpath``; writes rank 0's and rank 1's steps."""
    code = (
        "import json, sys\n"
        "from grstack.runtime.bench.train import bench_config\n"
        "from grstack.runtime.train import call_ranks\n"
        "p = json.loads(sys.argv[1])\n"
        "cfg = bench_config(True, p['microbatches'])\n"
        "ranks = call_ranks('train_ab:timed', 2, {'config': cfg.model_dump(mode='json'), 'modes': p['modes'],\n"
        "                   'steps': p['steps']}, limit_s=900)\n"
        "import grstack.runtime\n"
        "json.dump({'ranks': ranks, 'grstack': grstack.runtime.__file__}, open(sys.argv[2], 'w'))\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-P", "-c", code, json.dumps(payload), str(result)], env=env, check=True,
                   cwd=REPO)


def _summary_of_run(ranks: list[dict[str, Any]], warmup: int) -> dict[str, dict[str, float]]:
    """Per mode: medians over the timed steps (mean of the ranks) and the exposed ratios over them."""
    out: dict[str, dict[str, float]] = {}
    for mode in ranks[0]:
        per_rank = [r[mode][warmup:] for r in ranks]
        out[mode] = {
            "step_ms": statistics.mean(statistics.median(s["step_ms"] for s in st) for st in per_rank),
            "blocked_ms": statistics.mean(statistics.median(s["blocked_ms"] for s in st) for st in per_rank),
            "exposed_ratio": statistics.mean(sum(s["exposed_ms"] for s in st) / max(sum(s["comm_ms"] for s in st),
                                                                                    1e-9) for st in per_rank),
            "exposed_union_ratio": statistics.mean(
                sum(s["union_exposed_ms"] for s in st) / max(sum(s["union_ms"] for s in st), 1e-9)
                for st in per_rank),
        }
    return out


def paired(head: list[float], ref: list[float], resamples: int = 10_000) -> dict[str, Any]:
    """Geometric mean of head/ref over the runs with a 95 % bootstrap interval over the runs."""
    logs = [math.log(h / r) for h, r in zip(head, ref, strict=True) if h > 0 and r > 0]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    lo, hi = math.exp(means[int(0.025 * resamples)]), math.exp(means[int(0.975 * resamples) - 1])
    return {"ratio": math.exp(statistics.fmean(logs)), "ci95": [lo, hi], "no_worse": lo <= 1.0,
            "head_median": statistics.median(head), "ref_median": statistics.median(ref),
            "ratios": [h / r for h, r in zip(head, ref, strict=True)]}


def _install_ref(ref: str, into: Path) -> Path:
    src, site = into / "src", into / "site"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, stdout=subprocess.DEVNULL)
    return site


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the earlier commit")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode and run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--modes", default="sync,dbp,fwp,fwp_clustered,semi_async")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    n = args.microbatches
    every = {"sync": {}, "dbp": {"pipeline.dbp": True},  # bench train's modes (its pipeline_modes)
             "fwp": {"pipeline.dbp": True, "pipeline.microbatches": n},
             "fwp_clustered": {"pipeline.dbp": True, "pipeline.microbatches": n, "pipeline.cluster": True},
             "semi_async": {"pipeline.semi_async": True}}
    # the quick data holds 7 batches an epoch: enough epochs for every requested step
    payload = {"microbatches": n, "modes": {m: {**every[m], "train.epochs": 1 + (args.steps + args.warmup) // 7}
                                            for m in args.modes.split(",")},
               "steps": args.steps + args.warmup}
    t0 = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"ref": [], "head": []}
    where: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="grstack-ab-") as tmp:
        site = _install_ref(args.ref, Path(tmp))
        paths = {"ref": f"{site}{os.pathsep}{HERE}", "head": str(HERE)}  # head: the editable install
        for i in range(args.runs):
            for side in (("ref", "head") if i % 2 == 0 else ("head", "ref")):
                result = Path(tmp) / f"{side}-{i}.json"
                _engine_run(paths[side], payload, result)
                got = json.loads(result.read_text())
                where[side] = got["grstack"]
                runs[side].append(_summary_of_run(got["ranks"], args.warmup))
                print(f"[train ab] run {i + 1}/{args.runs} {side}: "
                      + ", ".join(f"{m} {v['step_ms']:.1f}/{v['blocked_ms']:.1f} ms"
                                  for m, v in runs[side][-1].items())
                      + f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    modes = list(runs["head"][0])
    summary = {m: {k: paired([r[m][k] for r in runs["head"]], [r[m][k] for r in runs["ref"]]) for k in METRICS}
               for m in modes}
    out = {"ref": args.ref, "head": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                                   capture_output=True, text=True).stdout.strip(),
           "dirty": bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True).stdout.strip()),
           "engines": where, "runs": args.runs, "steps": args.steps, "warmup": args.warmup,
           "microbatches": args.microbatches, "per_run": runs, "summary": summary,
           "wall_s": time.perf_counter() - t0}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

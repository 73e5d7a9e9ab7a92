"""The serving leg of ``grstack demo``: serve a trained run and send it a short open-loop load.

:func:`serve_demo` starts the embedded deployment (ranker processes + an in-process router with the
in-memory placement store), replays users of the run's dataset (long-term history, the last few events as
short-term behaviours, the held-out last item among random candidates), signals each user's prefix at
"retrieval time" just before its rank requests, and reports latency, cache hits, a ranking-quality
sanity figure and the largest score difference between relay answers and full inference.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHORT_TERM = 8
CANDIDATES = 20
SAME_SCORES = 1e-4  # relay (cached prefix) and full inference differ by float rounding only below this


def serve_demo(run_dir: Path, replicas: int = 2, requests: int = 200, *, qps: float = 40.0, seed: int = 0,
               print_report: bool = True, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the demo load against ``run_dir``'s ``model.pt`` and returns (and prints) a short report; ``say``
    gets a line as each phase (start-up, load) begins and ends."""
    report = asyncio.run(_demo(Path(run_dir), replicas, requests, qps, seed, say or (lambda line: None)))
    if print_report:
        print("\n".join(report_lines(report)))
    return report


def report_lines(report: dict[str, Any]) -> list[str]:
    """The serving leg's report, each figure with what it means (the top-1 rate next to chance's)."""
    c, diff = report["cache"], report["max_abs_score_diff"]
    same = " (the same scores, to float rounding)" if diff < SAME_SCORES else ""
    return [
        f"serving: {report['replicas']} ranker replica(s) behind a router at {report['url']}; "
        f"{report['ok']}/{report['requests']} rank requests answered, {report['errors']} errors",
        f"  latency p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms; prefix cache hits "
        f"{report['hit_rate']:.0%} (device {c['device']}, dram {c['dram']}, miss {c['miss']}); "
        f"{report['prefills_admitted']} prefill signals admitted",
        f"  held-out item ranked first among {CANDIDATES} candidates for {report['hr@1']:.0%} of requests "
        f"(chance {1 / CANDIDATES:.0%}); relay vs full inference max |score diff| {diff:.1e}{same}",
    ]


def _users(run_dir: Path, rng: Any, max_users: int) -> list[dict[str, Any]]:
    import numpy as np

    from grstack.runtime.data import read_dataset
    from grstack.runtime.errors import UserError

    ds = read_dataset(run_dir / "dataset")
    order = np.argsort(-ds.lengths, kind="stable")
    users = []
    for u in order[:max_users]:
        lo, hi = int(ds.offsets[u]), int(ds.offsets[u + 1])
        if hi - lo < SHORT_TERM + 3:
            break
        items, ts = ds.item_ids[lo:hi].tolist(), ds.timestamps[lo:hi].tolist()
        split = len(items) - 1 - SHORT_TERM
        target = items[-1]
        negs = [int(x) for x in rng.choice(np.arange(1, ds.num_items + 1), CANDIDATES * 2, replace=False)
                if x != target][: CANDIDATES - 1]
        cands = [target, *negs]
        users.append({"user_id": f"user-{int(ds.user_ids[u])}",
                      "long_term": {"items": items[:split], "timestamps": ts[:split]},
                      "short_term": {"items": items[split:-1], "timestamps": ts[split:-1]},
                      "candidates": cands, "timestamp": ts[-1]})
    if not users:
        raise UserError(f"{run_dir / 'dataset'}: no user has the {SHORT_TERM + 3} events the serving demo needs")
    return users


async def _demo(run_dir: Path, replicas: int, requests: int, qps: float, seed: int,
                say: Callable[[str], None]) -> dict[str, Any]:
    import numpy as np

    from grstack.runtime.model import resolve_model_file
    from grstack.runtime.serve.artifact import load_ranking_model
    from grstack.runtime.serve.engine import RelayEngine
    from grstack.runtime.serve.loadgen import Request, latency_summary, poisson_times, run_open_loop
    from grstack.runtime.serve.local import LocalCluster
    from grstack.runtime.serve.router import RouterConfig
    from grstack.runtime.serve.trigger import TriggerConfig

    checkpoint = resolve_model_file(run_dir)
    model, _ = load_ranking_model(checkpoint)
    max_suffix = max(1, min(64, model.max_len // 4))  # the ranker's default
    rng = np.random.default_rng(seed)
    users = _users(run_dir, rng, max_users=30)
    # Demo sequences are short, so the latency model rarely calls them at risk: admit the longer half.
    threshold = max(1, int(np.median([len(u["long_term"]["items"]) for u in users])))
    cfg = RouterConfig(trigger=TriggerConfig(length_threshold=min(threshold, model.max_len - max_suffix)))
    reqs = []
    for i, t in enumerate(poisson_times(qps, requests, rng)):
        u = users[i % len(users)]
        pre = {"user_id": u["user_id"], "long_term": u["long_term"]}
        reqs.append(Request(max(0.0, t - 0.02), "/v1/prefill", json.dumps(pre).encode(), u["user_id"], False))
        reqs.append(Request(float(t), "/v1/rank", json.dumps(u).encode(), u["user_id"], True))
    say(f"serving: starting {replicas} ranker process(es) and a router on loopback")
    t0 = time.perf_counter()
    async with LocalCluster(checkpoint, replicas, ["--threads", "1", "--log-level", "WARNING"], cfg) as cluster:
        say(f"serving: ready at {cluster.url} in {time.perf_counter() - t0:.1f} s")
        say(f"load: {requests} rank requests to {len(users)} users at {qps:g}/s (open loop), each after a "
            "prefill signal")
        t0 = time.perf_counter()
        results = await run_open_loop(cluster.url, reqs, timeout_s=10.0)
        say(f"load: done in {time.perf_counter() - t0:.1f} s")
    ranks = [r for r in results if r.request.measure]
    ok = [(r, r.payload) for r in ranks if r.status == 200 and r.payload is not None]
    cache = {k: sum(1 for _, p in ok if p["cache"] == k) for k in ("device", "dram", "miss")}
    admitted = sum(1 for r in results if not r.request.measure and r.status == 200 and r.payload is not None
                   and r.payload.get("admitted"))
    top1 = [int(np.argmax(np.asarray(p["scores"])[:, 0]) == 0) for _, p in ok]
    eng = RelayEngine(model, max_suffix=max_suffix)
    by_user = {u["user_id"]: u for u in users}
    diff = 0.0
    for r, payload in [(r, p) for r, p in ok if p["cache"] != "miss"][:5]:
        u = by_user[r.request.user]
        item = eng.canonical(u["long_term"]["items"], u["long_term"]["timestamps"], u["short_term"]["items"],
                             u["short_term"]["timestamps"], u["candidates"], u["timestamp"])
        full = eng.rank_encode([item])[0].numpy()
        diff = max(diff, float(np.abs(full - np.asarray(payload["scores"])).max()))
    lat = latency_summary(results)
    return {"url": cluster.url, "replicas": replicas, "requests": len(ranks), "ok": len(ok),
            "errors": len(ranks) - len(ok), "p50_ms": lat["p50_ms"], "p99_ms": lat["p99_ms"], "cache": cache,
            "hit_rate": (cache["device"] + cache["dram"]) / max(1, len(ok)), "prefills_admitted": admitted,
            "hr@1": float(np.mean(top1)) if top1 else 0.0, "max_abs_score_diff": diff}

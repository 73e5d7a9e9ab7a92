"""``grstack bench simulate``: a MODEL, not a measurement — step time and weak-scaling efficiency of the
training engine extrapolated to 128-1536 workers.

What is measured here (on this machine): the per-worker workload of the bench-train setting on synthetic
KuaiRand-like data — tokens, the exact jagged attention FLOPs (sum of L² per sequence), unique embedding
keys per step after deduplication, dense parameter count — and the engine's per-stage CPU times on one rank
(reported for reference). What is assumed (printed in ``assumptions``, all overridable): the accelerator
(peak FLOP/s and achieved MFU), the model size, and the network — nodes of ``devices_per_node`` with an
intra-node link and a slower inter-node link, each with a per-message latency:

* All2All inside a sparse group of G ranks: ``(G-1)·α + bytes·(remote share) / bandwidth`` — keys (8 B),
  rows and gradients (4·d B each) of the unique keys a worker looks up; the share of a group outside the
  node crosses the inter-node link.
* Replica sync (hierarchical: G < W): the touched rows' gradients all-reduced across W/G replicas
  (tree latency ``2·log2(W/G)·α``, ring bandwidth ``2·bytes/bw``).
* Dense all-reduce across W: ``2·log2(W)·α + 2·bytes/bw`` (hierarchical ring).
* Synchronous step: compute + every collective. Pipelined step (dual-buffer + N frozen-window
  micro-batches): key routing and retrieval hide behind the previous batch (DBP); rows/gradient All2Alls
  hide behind compute except one micro-batch's worth (FWP), and what does not fit behind compute shows;
  the dense all-reduce overlaps the backward pass (bucketed, two thirds of compute) except one bucket; the
  replica sync stays exposed.

Weak scaling: every worker keeps its batch (32 sequences); efficiency(W) = step(baseline) / step(W), the
baseline being the smallest worker count listed. The published figure it is compared with: 94% scaling
efficiency at 1,536 workers (NestPipe).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Any

PUBLISHED = {"scaling_efficiency": 0.94, "workers": 1536, "source": "NestPipe (nested pipelining, 1,536 workers)"}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="measure the workload on fewer steps")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.add_argument("--workers", default="128,256,512,1024,1536")
    parser.add_argument("--devices-per-node", type=int, default=16)
    parser.add_argument("--sparse-group", type=int, default=16, help="HSP group size (default: one node)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=300.0, help="accelerator peak (FP16/BF16)")
    parser.add_argument("--mfu", type=float, default=0.3, help="achieved fraction of peak for dense compute")
    parser.add_argument("--d-model", type=int, default=256, help="model and embedding width")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intra-gbps", type=float, default=196.0, help="intra-node GB/s per device")
    parser.add_argument("--inter-gbps", type=float, default=25.0, help="inter-node GB/s per device")
    parser.add_argument("--intra-latency-us", type=float, default=3.0)
    parser.add_argument("--inter-latency-us", type=float, default=15.0)
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[bench simulate] {msg}", file=sys.stderr, flush=True)


def workload(quick: bool) -> dict[str, Any]:
    """Per-worker statistics of the bench-train setting (2 ranks' split of a global batch), measured."""
    from grstack.runtime.bench.train import bench_config
    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.train import Preparer, Schedule, with_overrides

    cfg = with_overrides(bench_config(quick, 4), {"data.source": "small", "data.max_len": 256 if quick else 1024,
                                                  "loss.negatives": 512})
    split = LeaveOneOut(load_source(cfg.data))
    s = Schedule(split, cfg, 2, cfg.loss.ranking_candidates)
    prep = Preparer(s, cfg, 0, split.ds.num_items, 4, True)
    steps = min(3 if quick else 8, s.steps_in_epoch(0))
    tokens, sq, keys, seqs = [], [], [], []
    for i in range(steps):
        b = prep(0, i, i)
        tokens.append(b.local_tokens + b.local_seqs * cfg.loss.ranking_candidates)
        sq.append(sum(int((mb.full.lengths.double() ** 2).sum()) for mb in b.micro))
        keys.append(sum(u.num_keys for u in b.units))
        seqs.append(b.local_seqs)
    return {"tokens": statistics.mean(tokens), "sum_len_sq": statistics.mean(sq), "unique_keys": statistics.mean(keys),
            "sequences": statistics.mean(seqs), "negatives": cfg.loss.negatives, "data": cfg.data.source,
            "max_len": cfg.data.max_len}


def measured_stages(quick: bool) -> dict[str, float]:
    """The engine's per-stage CPU times on one rank (reference only; the model uses FLOPs and bytes)."""
    from grstack.runtime.bench.train import bench_config
    from grstack.runtime.train import call_ranks

    cfg = bench_config(quick, 4)
    steps = 3 if quick else 6
    recs = call_ranks("grstack.runtime.train.harness:run_modes", 1,
                      {"config": cfg.model_dump(mode="json"), "modes": {"sync": {}}, "steps": steps,
                       "params": False})[0]["sync"]["records"][1:]
    return {k: statistics.median(r[k] for r in recs) for k in ("step_ms", "compute_ms", "sparse_update_ms",
                                                               "exposed_comm_ms")}


def hstu_flops(w: dict[str, Any], d: int, layers: int, heads: int = 4) -> float:
    """Training FLOPs per worker step: forward (linear layers + causal jagged attention counted from the
    exact per-sequence L²) times 3 for forward + backward, plus the sampled-softmax logits."""
    dh = d // heads
    linear = 2 * w["tokens"] * (d * 4 * d + d * d)  # U,V,Q,K projection and the output projection
    attention = 2 * heads * 2 * dh * w["sum_len_sq"] / 2  # QK^T and AV over causal pairs
    softmax = 2 * w["tokens"] * d * w["negatives"]
    return 3 * (layers * (linear + attention) + softmax)


def dense_params(d: int, layers: int) -> int:
    return layers * (d * 4 * d + 4 * d + d * d + d) + 2 * d * d


def _all2all_ms(group: int, per_node: int, nbytes: float, a: argparse.Namespace) -> float:
    if group <= 1:
        return 0.0
    local = min(group, per_node)
    remote_share = (group - local) / group
    intra_share = (local - 1) / group
    lat = (local - 1) * a.intra_latency_us + (group - local) * a.inter_latency_us
    bw = nbytes * intra_share / (a.intra_gbps * 1e9) + nbytes * remote_share / (a.inter_gbps * 1e9)
    return lat / 1e3 + bw * 1e3


def _allreduce_ms(members: int, nbytes: float, a: argparse.Namespace, inter: bool) -> float:
    if members <= 1:
        return 0.0
    alpha = a.inter_latency_us if inter else a.intra_latency_us
    bw = a.inter_gbps if inter else a.intra_gbps
    return 2 * math.ceil(math.log2(members)) * alpha / 1e3 + 2 * nbytes * (members - 1) / members / (bw * 1e9) * 1e3


def step_model(W: int, w: dict[str, Any], a: argparse.Namespace, group: int) -> dict[str, float]:
    d = a.d_model
    compute = hstu_flops(w, d, a.layers) / (a.peak_tflops * 1e12 * a.mfu) * 1e3
    keys = w["unique_keys"]
    route = _all2all_ms(group, a.devices_per_node, keys * 8, a)
    rows = _all2all_ms(group, a.devices_per_node, keys * 4 * d, a)
    grads = _all2all_ms(group, a.devices_per_node, keys * 4 * d, a)
    replicas = W // group
    # a shard's touched rows: the group's unique keys spread over G shards (upper bound: no overlap)
    replica = _allreduce_ms(replicas, keys * 4 * d, a, inter=True)
    dense = _allreduce_ms(W, dense_params(d, a.layers) * 4, a, inter=a.devices_per_node < W)
    sync = compute + route + rows + grads + replica + dense
    n = a.microbatches
    dense_exposed = max(dense - 2 * compute / 3, dense / n)
    hidden = route + (rows + grads) * (n - 1) / n
    pipelined = max(compute, hidden) + (rows + grads) / n + replica + dense_exposed
    return {"compute_ms": compute, "all2all_keys_ms": route, "all2all_rows_ms": rows, "all2all_grads_ms": grads,
            "replica_sync_ms": replica, "dense_allreduce_ms": dense, "step_ms_sync": sync,
            "step_ms_pipelined": pipelined}


def run(args: argparse.Namespace) -> int:
    workers = [int(x) for x in args.workers.split(",")]
    _log("measuring the per-worker workload on synthetic KuaiRand-like data")
    w = workload(args.quick)
    stages = measured_stages(args.quick)
    _log(f"workload {w}; CPU stages {stages}")
    base_w = min(workers)
    out_rows = []
    for flavour, group_of in (("hierarchical", lambda W: min(args.sparse_group, W)), ("flat", lambda W: W)):
        base = step_model(base_w, w, args, group_of(base_w))
        for W in workers:
            m = step_model(W, w, args, group_of(W))
            out_rows.append({"sharding": flavour, "workers": W, "sparse_group_size": group_of(W), **m,
                             "scaling_efficiency_sync": base["step_ms_sync"] / m["step_ms_sync"],
                             "scaling_efficiency_pipelined": base["step_ms_pipelined"] / m["step_ms_pipelined"]})
    best = next(r for r in out_rows if r["sharding"] == "hierarchical" and r["workers"] == max(workers))
    out = {
        "kind": "model, not a measurement",
        "assumptions": {k: getattr(args, k) for k in ("devices_per_node", "sparse_group", "microbatches",
                                                      "peak_tflops", "mfu", "d_model", "layers", "intra_gbps",
                                                      "inter_gbps", "intra_latency_us", "inter_latency_us")}
        | {"baseline": f"{base_w} workers, weak scaling (32 sequences per worker)"},
        "measured_workload_per_worker": w,
        "measured_cpu_stage_ms_one_rank": stages,
        "rows": out_rows,
        "published": PUBLISHED,
        "modelled_vs_published": {"workers": best["workers"],
                                  "scaling_efficiency_pipelined": best["scaling_efficiency_pipelined"],
                                  "published": PUBLISHED["scaling_efficiency"]},
    }
    print(json.dumps(out, indent=2))
    return 0

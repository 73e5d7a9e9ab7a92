"""``grstack bench train``: the distributed training engine on 2 local gloo ranks (CPU), synthetic
KuaiRand-like data. Prints one JSON object on stdout; progress and details on stderr.

* ``imbalance_measured``: the measured balance, before (``balance.mode=count``: each rank takes an equal
  count of a global batch) and after (``balance.mode=tokens``: token-balanced reallocation). Two engines,
  one per split, train on the same data from the same initial state on 2 ranks at KuaiRand-like lengths
  (the 27k preset up to 4096 tokens; ``--quick``: the small preset up to 1024), their steps interleaved so
  both see the same machine load: every step runs the same sequences, only the split differs. Each step
  gathers every rank's busy time (its own work until it is ready for the dense all-reduce, waits for
  communication left out: ``Engine.step``). ``before`` / ``after``: the median over the timed steps (after
  ``warmup_steps``) of the measured wait ratio sum_r (max - busy_r) / (W · max); ``mean``, ``p10``, ``p90``
  of the same; ``imbalance``: median (max - mean) / mean of the busy times; ``cpu``: the same wait ratio
  from the main thread's CPU time (what the rank computed, without the time the OS gave to other
  processes); ``cost_model``: the cost model's wait ratio of the same steps; ``noise_floor``: the median
  wait ratio between two timings of the same work (a third engine repeats ``after`` step for step; per rank
  and step, the pair's (max - min) / (2 max)), what timing noise alone makes of a perfect 2-rank split.
* ``imbalance_before`` / ``imbalance_after`` (the cost model's, named in ``imbalance_cost_model``): mean
  over an epoch of (max - mean) / mean of per-rank cost a·L + b·L² under the two splits, at the same
  lengths. The balancer minimises this cost, so ``after`` is near zero by construction: it is not a
  measurement.
* ``step_ms``: median step time of the same training from the same state under four settings, cumulative
  like the nested pipeline: ``sync`` (no pipelining), ``dbp`` (dual-buffer), ``fwp`` (dual-buffer plus N
  frozen-window micro-batches), ``fwp_clustered`` (plus key-centric clustering). ``microbatches`` is N.
* ``exposed_comm_ratio``: in ``fwp``, the steps' communication events (lookups, row and gradient sends,
  the dense all-reduce from launch to the end of its wait, the main thread's own collectives): the part of
  their time during which the compute thread was blocked, over their whole time (1.0: nothing overlapped;
  ``grstack.runtime.train.timing``).
* ``unique_keys_per_microbatch``: deduplicated ids each micro-batch looks up, batch order vs clustered.
* ``dbp_max_abs_diff``: largest parameter difference after training, ``dbp`` vs ``sync`` (0.0: bitwise);
  ``fwp_max_abs_diff``: ``fwp`` vs ``dbp`` (N micro-batch gradient sums vs one; dropout is off).
* ``tokens_per_second``: global training tokens per second of the fastest setting.
* ``embedding_step_ms``: the TorchRec comparison case — one 1,000,000 x 64 table row-sharded over the 2
  ranks, 32 sequences of 100-300 uniformly random ids per rank, row-wise Adagrad; median of a lookup
  (All2All), a trivial forward/backward and the update. ``torchrec`` is null when torchrec is not installed
  (``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 ...``, see pyproject's torchrec extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SETTINGS = ("sync", "dbp", "fwp", "fwp_clustered")


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller data and fewer steps (a minute or two)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="measured steps per setting")
    parser.add_argument("--balance-steps", type=int, default=None,
                        help="timed steps per split of the measured balance (default 20; 30 without --quick)")
    parser.add_argument("--no-embedding", action="store_true", help="skip the embedding-step comparison")
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[bench train] {msg}", file=sys.stderr, flush=True)


def bench_config(quick: bool, microbatches: int) -> Any:
    from grstack.runtime.training_config import Config

    return Config.model_validate({
        "name": "bench-train",
        "data": {"format": "synth", "source": "tiny" if quick else "small", "max_len": 128 if quick else 256},
        "model": {"type": "hstu", "d_model": 64, "num_blocks": 2, "num_heads": 2, "dqk": 32, "dv": 32,
                  "dropout": 0.0, "input_dropout": 0.0},
        "loss": {"negatives": 256, "sharing": "batch", "ranking_candidates": 8},
        "optim": {"lr": 0.001},
        "train": {"batch_size": 64, "seed": 0},
        "pipeline": {"microbatches": 1},
        "negatives": {"prefetch": 2},
        "distributed": {"timeout_s": 120},
    })


def imbalance_stats(cfg: Any, world: int) -> tuple[float, float]:
    import numpy as np

    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.train import Schedule, imbalance

    split = LeaveOneOut(load_source(cfg.data))
    s = Schedule(split, cfg, world, cfg.loss.ranking_candidates)
    before, after = [], []
    for step in range(s.steps_in_epoch(0)):
        rows = s.step_rows(0, step)
        before.append(imbalance(s.costs(rows, s.parts(rows, "count"))))
        after.append(imbalance(s.costs(rows, s.parts(rows, "tokens"))))
    return float(np.mean(before)), float(np.mean(after))


IMBALANCE_COST_MODEL = ("imbalance_before/after: mean over an epoch of (max - mean) / mean of the per-rank cost "
                        "a*L + b*L^2 the balancer minimises (equal counts / token balanced): the cost model's "
                        "figure, not a measurement; imbalance_measured holds the measured one")


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=np.float64), 100 * q))


def measured_balance_stats(long: Any, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """Measured wait ratio before (equal counts) and after (token balanced): see the module docstring."""
    from grstack.runtime.train import call_ranks, measured_balance, with_overrides

    # sync steps, batches prepared inline (outside the timed step): nothing else of the rank runs while it
    # computes, so a rank's busy time is its own work
    cfg = with_overrides(long, {"negatives.background": False, "train.num_threads": 1,
                                "pipeline.microbatches": 1, "pipeline.dbp": False})
    # "repeat" does exactly what "after" does: the two timings of one rank's same work give the noise floor
    modes = {"before": {"balance.mode": "count"}, "after": {"balance.mode": "tokens"},
             "repeat": {"balance.mode": "tokens"}}
    res = call_ranks("grstack.runtime.train.harness:run_modes", world,
                     {"config": cfg.model_dump(mode="json"), "modes": modes, "steps": steps + warmup,
                      "params": False, "interleave": True})
    timed = {m: [r[m]["records"][warmup:] for r in res] for m in modes}  # [rank][step]
    # the same global batches (sequences, tokens) in both: only their split across ranks differs
    same = all(a["samples"] == b["samples"] and a["tokens"] == b["tokens"]
               for a, b in zip(res[0]["before"]["records"], res[0]["after"]["records"], strict=True))
    out: dict[str, Any] = {
        "what": "wait ratio sum_r (max - busy_r) / (W * max) of every rank's measured busy time per step "
                "(before: balance.mode=count, after: balance.mode=tokens); median over the timed steps",
        "ranks": world, "timed_steps": len(timed["after"][0]), "warmup_steps": warmup,
        "data": f"{cfg.data.source} preset, max_len {cfg.data.max_len}", "global_batch": cfg.train.batch_size,
        "same_global_batches": same}
    wall, imb, cpu, model = {}, {}, {}, {}
    noise = [measured_balance([1e-3 * a["busy_ms"], 1e-3 * b["busy_ms"]])["wait_ratio_measured"]
             for rank in range(world) for a, b in zip(timed["after"][rank], timed["repeat"][rank], strict=True)]
    del modes["repeat"]
    for m in modes:
        recs = timed[m]
        # the all-reduced figures are the same on every rank: rank 0's records hold them
        wall[m] = [r["wait_ratio_measured"] for r in recs[0]]
        imb[m] = [r["imbalance_measured"] for r in recs[0]]
        model[m] = [r["wait_ratio"] for r in recs[0]]
        cpu[m] = [measured_balance([1e-3 * rank[i]["busy_cpu_ms"] for rank in recs])["wait_ratio_measured"]
                  for i in range(len(recs[0]))]
    for m in modes:
        out[m] = statistics.median(wall[m])
    out["mean"] = {m: statistics.mean(wall[m]) for m in modes}
    out["p10"] = {m: _pct(wall[m], 0.1) for m in modes}
    out["p90"] = {m: _pct(wall[m], 0.9) for m in modes}
    out["imbalance"] = {m: statistics.median(imb[m]) for m in modes}
    out["cpu"] = {m: statistics.median(cpu[m]) for m in modes}
    out["cost_model"] = {m: statistics.median(model[m]) for m in modes}
    out["busy_ms_max"] = {m: statistics.median(r["busy_ms_max"] for r in timed[m][0]) for m in modes}
    out["noise_floor"] = statistics.median(noise)
    return out


def _median_after_warmup(values: list[float], warmup: int) -> float:
    tail = values[warmup:] or values
    return float(statistics.median(tail))


# -- the embedding step: grstack and TorchRec on the same case -------------------------------------------------
def _embedding_batches(rank: int, steps: int, seqs: int, rows: int) -> list[tuple[Any, Any]]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(100, 301, (seqs,), generator=g)
        out.append((torch.randint(0, rows, (int(lengths.sum()),), generator=g), lengths))
    return out


def _torchrec_model(env: Any, rows: int, dim: int) -> Any:
    """TorchRec's answer to the same case: an EmbeddingCollection sharded by rows with FBGEMM's fused
    row-wise Adagrad, on the default (gloo) process group."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="item_table", embedding_dim=dim, num_embeddings=rows,
                                                     feature_names=["item"])], device=torch.device("meta"))
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                       "learning_rate": 0.01})
    constraints = {"item_table": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=env.world_size, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(ec, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(ec, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def embedding_rank(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One rank of the embedding-step comparison. grstack's step: dedupe, route (All2All of keys), retrieve,
    rows All2All, a trivial forward/backward, gradient All2All, row-wise Adagrad. With ``torchrec``, the
    TorchRec step runs right after each grstack step on the same ids, so both see the same machine load.
    Then grstack again with the next batch's routing and retrieval prefetched in a thread (dual buffer)."""
    import threading

    import torch

    from grstack.runtime.embedding import RowWiseAdagrad, ShardedEmbedding, ShardingPlan, make_unit
    from grstack.runtime.train import DistContext

    torch.set_num_threads(payload["threads"])
    rows, dim, steps = payload["rows"], payload["dim"], payload["steps"]
    ctx = DistContext(env, torch.device("cpu"), 0, 120.0)
    plan = ShardingPlan.make(rows, dim, ctx.world_size)
    shard = torch.randn(plan.shard_rows(plan.shard_of(ctx.rank)), dim, generator=torch.Generator().manual_seed(0))
    table = ShardedEmbedding(plan, ctx.rank, shard, RowWiseAdagrad(shard, lr=0.01))
    trec = _torchrec_model(env, rows, dim) if payload["torchrec"] else None
    batches = _embedding_batches(ctx.rank, steps, payload["seqs"], rows)
    w = torch.randn(dim)

    def lookup(ids, comm):
        unit, inv, _ = make_unit(ids)
        rb = table.route([unit], comm)
        table.retrieve(rb)
        return rb, unit, inv

    def finish(rb, unit, inv):
        leaf = table.send_rows(rb, unit, ctx.sparse_fwd, fp16=False).requires_grad_(True)
        (leaf[inv] * w).sum().backward()
        table.send_grads(rb, unit, leaf.grad, ctx.sparse_fwd)
        return table.apply(rb, ctx.replica)

    ours, theirs = [], []
    for ids, lengths in batches:
        ctx.world.barrier()
        t0 = time.perf_counter()
        finish(*lookup(ids, ctx.sparse_fwd))
        ours.append(1e3 * (time.perf_counter() - t0))
        if trec is not None:
            from torchrec import KeyedJaggedTensor

            kjt = KeyedJaggedTensor(keys=["item"], values=ids, lengths=lengths)
            ctx.world.barrier()
            t0 = time.perf_counter()
            (trec(kjt)["item"].values() * w).sum().backward()
            theirs.append(1e3 * (time.perf_counter() - t0))
    piped = []
    box: dict[str, Any] = {}

    def prefetch(ids):
        box["next"] = lookup(ids, ctx.sparse_pre)

    ctx.world.barrier()
    nxt = lookup(batches[0][0], ctx.sparse_fwd)
    active = None
    for i in range(len(batches)):
        t0 = time.perf_counter()
        rb, unit, inv = nxt
        table.refresh(rb, active)
        th = None
        if i + 1 < len(batches):
            th = threading.Thread(target=prefetch, args=(batches[i + 1][0],))
            th.start()
        active = finish(rb, unit, inv)
        if th is not None:
            th.join()
            nxt = box["next"]
        piped.append(1e3 * (time.perf_counter() - t0))
    return {"grstack": ours, "torchrec": theirs, "grstack_pipelined": piped,
            "ids_per_step": statistics.mean(int(b[0].numel()) for b in batches)}


def torchrec_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception:  # ImportError, or a build that does not load against this torch
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.errors import UserError
    from grstack.runtime.train import call_ranks, max_abs_diff

    t_start = time.perf_counter()
    quick, world, n = args.quick, args.nproc, args.microbatches
    cfg = bench_config(quick, n)
    steps = args.steps or (5 if quick else 12)
    warmup = 1 if quick else 2
    _log(f"data {cfg.data.source} (synthetic KuaiRand-like), {world} ranks, global batch {cfg.train.batch_size}")
    from grstack.runtime.train import with_overrides

    # balancing matters with long, heavy-tailed histories: measured at KuaiRand-like lengths
    long = with_overrides(cfg, {"data.source": "small" if quick else "27k", "data.max_len": 1024 if quick else 4096})
    before, after = imbalance_stats(long, world)
    _log(f"cost-model imbalance ({long.data.source} preset, max_len {long.data.max_len}, a={cfg.balance.cost_a}, "
         f"b={cfg.balance.cost_b}): equal counts {before:.3f}, token balanced {after:.5f}")
    bsteps = args.balance_steps or (20 if quick else 30)
    measured = measured_balance_stats(long, world, bsteps, 3 if quick else 5)
    _log(f"measured wait ratio over {measured['timed_steps']} steps (median): equal counts "
         f"{measured['before']:.3f}, token balanced {measured['after']:.3f} (CPU time: {measured['cpu']['before']:.3f}"
         f" -> {measured['cpu']['after']:.3f}; the cost model on the same steps: "
         f"{measured['cost_model']['before']:.3f} -> {measured['cost_model']['after']:.5f}; timing noise alone: "
         f"{measured['noise_floor']:.3f})")
    # key-centric clustering's host cost per rank batch at these lengths, with group-shared negatives (the
    # sets' keys are what makes it expensive), beside the step time
    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.train import Schedule, cluster_time_per_batch

    ccfg = with_overrides(long, {"loss.sharing": "group", "loss.group_size": 16, "loss.negatives": 512,
                                 "pipeline.microbatches": n})
    csplit = LeaveOneOut(load_source(ccfg.data), min_len=ccfg.data.min_len)
    clustering = cluster_time_per_batch(Schedule(csplit, ccfg, world, ccfg.loss.ranking_candidates), ccfg,
                                        csplit.ds.num_items, steps=3 if quick else 5)
    _log(f"clustering ({long.data.source}, max_len {long.data.max_len}, group-shared negatives): "
         f"{clustering['cluster_ms_per_batch']:.1f} ms per rank batch, {clustering['keys_per_token']:.1f} keys "
         f"per token, unique keys {clustering['unique_keys_total']['contiguous']:.0f} -> "
         f"{clustering['unique_keys_total']['clustered']:.0f}")
    modes = {"sync": {}, "dbp": {"pipeline.dbp": True},
             "fwp": {"pipeline.dbp": True, "pipeline.microbatches": n},
             "fwp_clustered": {"pipeline.dbp": True, "pipeline.microbatches": n, "pipeline.cluster": True}}
    runs = call_ranks("grstack.runtime.train.harness:run_modes", world,
                      {"config": cfg.model_dump(mode="json"), "modes": modes, "steps": steps + warmup})[0]
    step_ms = {m: _median_after_warmup([r["step_ms"] for r in runs[m]["records"]], warmup) for m in SETTINGS}
    fwp = runs["fwp"]["records"][warmup:]
    exposed = sum(r["exposed_comm_ms"] for r in fwp) / max(sum(r["comm_ms"] for r in fwp), 1e-9)
    keys = {k: statistics.mean(r["unique_keys_per_microbatch"] for r in runs[m]["records"])
            for k, m in (("random", "fwp"), ("clustered", "fwp_clustered"))}
    tokens = statistics.mean(r["tokens"] for r in runs["sync"]["records"])
    fastest = min(step_ms, key=step_ms.get)
    _log(f"step ms {step_ms}; fastest {fastest}")
    out: dict[str, Any] = {
        "imbalance_before": before,
        "imbalance_after": after,
        "imbalance_cost_model": IMBALANCE_COST_MODEL,
        "imbalance_measured": measured,
        "step_ms": step_ms,
        "exposed_comm_ratio": exposed,
        "microbatches": n,
        "unique_keys_per_microbatch": keys,
        "cluster_ms_per_batch": clustering["cluster_ms_per_batch"],
        "clustering": clustering,
        "dbp_max_abs_diff": max_abs_diff(runs["sync"]["params"], runs["dbp"]["params"]),
        "fwp_max_abs_diff": max_abs_diff(runs["dbp"]["params"], runs["fwp"]["params"]),
        "tokens_per_second": tokens / (step_ms[fastest] / 1e3),
        "embedding_step_ms": {"grstack": None, "torchrec": None},
        "embedding_step_ratio": None,
    }
    if not args.no_embedding:
        with_torchrec = torchrec_available()
        if not with_torchrec:
            _log("torchrec is not installed: embedding_step_ms.torchrec is null")
        payload = {"rows": 1_000_000, "dim": 64, "seqs": 32, "steps": 8 if quick else 20, "threads": 1,
                   "torchrec": with_torchrec}
        ew = 2 if quick else 3
        try:
            res = call_ranks("grstack.runtime.bench.train:embedding_rank", 2, payload)
        except UserError as exc:  # an optional comparison must not sink the benchmark
            if not with_torchrec:
                raise
            _log(f"torchrec comparison failed ({exc}); measuring grstack alone")
            res = call_ranks("grstack.runtime.bench.train:embedding_rank", 2, {**payload, "torchrec": False})
        ours = max(_median_after_warmup(r["grstack"], ew) for r in res)
        piped = max(_median_after_warmup(r["grstack_pipelined"], ew) for r in res)
        _log(f"embedding step: grstack {ours:.1f} ms ({res[0]['ids_per_step']:.0f} ids per rank), with the "
             f"next lookup prefetched {piped:.1f} ms")
        out["embedding_step_ms"]["grstack"] = ours
        if res[0]["torchrec"]:
            theirs = max(_median_after_warmup(r["torchrec"], ew) for r in res)
            out["embedding_step_ms"]["torchrec"] = theirs
            out["embedding_step_ratio"] = ours / theirs
            _log(f"embedding step: torchrec {theirs:.1f} ms")
    _log(f"done in {time.perf_counter() - t_start:.0f} s")
    print(json.dumps(out, indent=2))
    return 0

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
* ``blocked_comm_ms``: per setting, the median over the timed steps of the time the training thread was
  blocked on communication in a step (every wait for a lookup, rows, gradient sends, the buckets, the stats;
  at world size 1 the inline events): unlike ``exposed_comm_ratio``, events in flight at the same time do
  not each count, so it is the step time communication actually costs the compute thread.
* ``collectives``: a short logged run (``steps``: 3 with ``--quick``, else 6; separate from the timed one,
  so logging does not disturb its timing) of every pipeline mode on the same ranks (``modes``: the four
  above and ``semi_async``, ``pipeline.semi_async`` being the alternative to DBP; ``pipeline_modes``), every
  collective logged (``embedding.CommLog``) and audited by ``grstack.runtime.train.audit_collectives``:
  ``order_violations`` (summed over the modes: positions where a rank's merged order of device-communicator
  collectives, or one communicator's own order, differs from rank 0's; NCCL/HCCL need 0) and
  ``issuing_threads_per_communicator_max`` (the most threads one rank issued one communicator's collectives
  from, over the modes; 1 is the target); ``device_issuing_threads_per_rank_max``: the most threads one rank
  issued device collectives from (1: one issuing thread, so the order is the program's on every run, not
  only on this sample of the threads' timing); ``per_mode`` the audit of each (per communicator: threads,
  issues, first mismatch).
  On gloo the audit attributes host data (integer tensors, barriers) to the ``*-meta`` twin NCCL would use.
* ``host_syncs_per_step``: from the same logged run, each step's host syncs as ``device.host_sync_counter``
  counts them: ``value`` the largest over the modes (``mode``) of rank 0's mean per step (``per_mode``
  each); ``counter`` what was counted — on CUDA its sync debug mode (every host-device synchronisation), on
  CPU ``grstack.kernels.HostSyncCount``: the aten operators and reads of the training thread that block the
  host on CUDA (scalar reads, ``nonzero``, bool-mask indexing, ``unique``, blocking copies, ``.cpu/.tolist``),
  an upper bound: nothing waits on CPU, and reads of host data count too.
* ``unique_keys_per_microbatch``: deduplicated ids each micro-batch looks up, batch order vs clustered.
* ``dbp_max_abs_diff``: largest parameter difference after training, ``dbp`` vs ``sync`` (0.0: bitwise);
  ``fwp_max_abs_diff``: ``fwp`` vs ``dbp`` (N micro-batch gradient sums vs one; dropout is off).
* ``tokens_per_second``: global training tokens per second of the fastest setting.
* ``events_read_fraction_max``: a short run (with evaluation) of the ranks reading only their shares of
  the synthetic data written as Parquet (``data.read: shard``): the largest share of all events one rank
  decoded (a row group cut for several ranks counts whole for each). ``table_rows_fraction_max``: the
  largest item-table tensor any rank of that run held (its shard, or anything gathered), over the table's
  rows (the trainer's own accounting). Details in ``sharded_data``.
* ``embedding_step_ms``: the TorchRec comparison case — one 1,000,000 x 64 table row-sharded over the 2
  ranks, 32 sequences of 100-300 ids per rank and step, Zipf-skewed (``embedding_ids``: exponent 1.05 over
  the rows, a fixed seed per rank and step, the same ids on both sides; ``duplicate_share`` = 1 -
  unique/total per rank and step, mean and range), row-wise Adagrad, dedup on both sides (grstack: always;
  TorchRec: ``EmbeddingCollectionSharder(use_index_dedup=True)``, whose fbgemm op has no CPU kernel in
  fbgemm-gpu-cpu 1.8.0: the bench registers one); median over the timed steps (after 10 warm-up steps; 100
  with ``--quick``, else 300; a step's time is its slowest rank's) of a lookup (All2All), a trivial
  forward/backward and the update, the two sides alternating step by step. ``embedding_step_ratio``:
  grstack / TorchRec. ``embedding_step_ms_pipelined`` / ``embedding_step_ratio_pipelined``: the same with
  the next batch's lookup overlapped — grstack's routing and retrieval prefetched in a thread (dual
  buffer), TorchRec's ``TrainPipelineSparseDist`` (the next input dist started before the current
  forward). ``embedding_step_spread_ms``: median, p10, p90 of each. TorchRec's figures are null when
  torchrec is not installed (``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 ...``, see
  pyproject's torchrec extra).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

SETTINGS = ("sync", "dbp", "fwp", "fwp_clustered")


def pipeline_modes(n: int) -> dict[str, dict[str, Any]]:
    """Every pipeline mode as ``harness.run_modes`` overrides: the timed ``SETTINGS`` and semi-async."""
    return {"sync": {}, "dbp": {"pipeline.dbp": True},
            "fwp": {"pipeline.dbp": True, "pipeline.microbatches": n},
            "fwp_clustered": {"pipeline.dbp": True, "pipeline.microbatches": n, "pipeline.cluster": True},
            "semi_async": {"pipeline.semi_async": True}}


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--quick", action="store_true", help="smaller data and fewer steps (a minute or two)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.add_argument("--nproc", type=ca.positive_int, default=2, help="ranks (default 2)")
    parser.add_argument("--microbatches", type=ca.positive_int, default=4,
                        help="micro-batches per batch of the pipelining comparison")
    parser.add_argument("--steps", type=ca.positive_int, default=None, help="measured steps per setting")
    parser.add_argument("--balance-steps", type=ca.positive_int, default=None,
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


def with_steps(cfg: Any, world: int, steps: int) -> Any:
    """``cfg`` with enough epochs for ``steps`` batches on ``world`` ranks (the harness stops at the end of
    training: the quick data holds 7 batches an epoch, so ``--steps 20`` would otherwise time 7)."""
    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.train import Schedule, with_overrides

    split = LeaveOneOut(load_source(cfg.data), min_len=cfg.data.min_len, block=cfg.ranking_block())
    per_epoch = max(1, Schedule(split, cfg, world, cfg.loss.ranking_candidates).steps_in_epoch(0))
    return with_overrides(cfg, {"train.epochs": max(cfg.train.epochs, -(-steps // per_epoch))})


def measured_balance_stats(long: Any, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """Measured wait ratio before (equal counts) and after (token balanced): see the module docstring."""
    from grstack.runtime.train import call_ranks, measured_balance, with_overrides

    # sync steps, batches prepared inline (outside the timed step): nothing else of the rank runs while it
    # computes, so a rank's busy time is its own work
    cfg = with_steps(with_overrides(long, {"negatives.background": False, "train.num_threads": 1,
                                           "pipeline.microbatches": 1, "pipeline.dbp": False}), world, steps + warmup)
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
ZIPF_EXPONENT = 1.05
TORCHREC_DEDUP = ("EmbeddingCollectionSharder(use_index_dedup=True): fbgemm::jagged_unique_indices over each "
                  "rank's batch before the input dist; fbgemm-gpu-cpu 1.8.0 has no CPU kernel for that op, so "
                  "the bench registers one (torch.unique, as grstack's make_unit)")
GRSTACK_DEDUP = "make_unit: torch.unique over each rank's batch before routing (always on)"


def _zipf_batches(rank: int, steps: int, seqs: int, rows: int, exponent: float, seed: int = 0
                  ) -> list[tuple[Any, Any]]:
    """``steps`` batches of ``seqs`` sequences of 100-300 ids, the ids Zipf-distributed over the table: the
    k-th most popular of ``rows`` ids has probability ∝ k^-exponent. Popularity ranks map to rows through a
    fixed random permutation (the same on every rank), so the hot rows are spread over the shards under both
    row shardings (grstack's strided one, TorchRec's contiguous blocks). Seeded per rank and step."""
    import torch

    cdf = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent), 0)
    cdf /= cdf[-1].clone()
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + 1_000_003 * (rank + 1) + step)
        lengths = torch.randint(100, 301, (seqs,), generator=g)
        ranks = torch.searchsorted(cdf, torch.rand(int(lengths.sum()), generator=g, dtype=torch.float64))
        out.append((perm[ranks.clamp_(max=rows - 1)], lengths))
    return out


def _jagged_unique_indices_cpu(hash_size_cumsum: Any, hash_size_offsets: Any, offsets: Any, indices: Any
                               ) -> tuple[Any, Any, Any, Any]:
    """A CPU kernel for ``fbgemm::jagged_unique_indices`` (TorchRec's EC index dedup), which fbgemm-gpu-cpu
    1.8.0 ships for CUDA only; the same contract as the CUDA one: the sorted unique ids of each feature over
    the whole batch, their count per group spread evenly over the group's lengths, and every input id's
    index into them."""
    import torch

    T = hash_size_cumsum.numel() - 1
    total_b = offsets.numel() - 1
    B = total_b // T
    base = hash_size_cumsum[:-1].repeat_interleave(B).repeat_interleave(offsets[1:] - offsets[:-1])
    uniq, reverse = torch.unique(indices.to(torch.int64) + base, sorted=True, return_inverse=True)
    feature = torch.searchsorted(hash_size_cumsum, uniq, right=True) - 1
    unique_indices = (uniq - hash_size_cumsum[feature]).to(indices.dtype)
    lengths = torch.zeros(total_b, dtype=offsets.dtype)
    groups = hash_size_offsets.tolist()
    for lo_f, hi_f in itertools.pairwise(groups):
        n = (hi_f - lo_f) * B
        bounds = torch.searchsorted(uniq, hash_size_cumsum[[lo_f, hi_f]])
        total = int(bounds[1] - bounds[0])
        if n and total:
            seg = torch.full((n,), total // n, dtype=offsets.dtype)
            seg[: total % n] += 1
            lengths[lo_f * B : hi_f * B] = seg
    out_offsets = torch.zeros(total_b + 1, dtype=offsets.dtype)
    out_offsets[1:] = torch.cumsum(lengths, 0)
    return lengths, out_offsets, unique_indices, reverse


def _torchrec_model(env: Any, rows: int, dim: int, w: Any, dedup: bool = True) -> Any:
    """TorchRec's answer to the same case: an EmbeddingCollection sharded by rows with FBGEMM's fused
    row-wise Adagrad and TorchRec's index dedup (``dedup``), on the default (gloo) process group; the trivial
    forward inside the model (``w`` a buffer: no dense parameter, no DDP), so TrainPipelineSparseDist can run
    it."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    if not torch._C._dispatch_has_kernel_for_dispatch_key("fbgemm::jagged_unique_indices", "CPU"):
        torch.library.impl("fbgemm::jagged_unique_indices", "CPU")(_jagged_unique_indices_cpu)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
                name="item_table", embedding_dim=dim, num_embeddings=rows, feature_names=["item"])],
                device=torch.device("meta"))
            self.register_buffer("w", w.clone())

        def forward(self, batch: Any) -> tuple[Any, Any]:
            loss = (self.ec(batch.sparse_features)["item"].values() * self.w).sum().reshape(1)
            return loss, loss.detach()

    model = Model()
    sharder = EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                       "learning_rate": 0.01}, use_index_dedup=dedup)
    constraints = {"item_table": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=env.world_size, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])


def embedding_rank(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """One rank of the embedding-step comparison, on Zipf-skewed ids (the same on both sides), dedup on both.

    grstack's step: dedupe, route (All2All of keys), retrieve, rows All2All, a trivial forward/backward,
    gradient All2All, row-wise Adagrad. TorchRec's: its model on a KJT of the same ids (index dedup, input
    dist, lookup, output dist, backward with the fused update). The two alternate step by step (which one
    goes first alternates too), each after a barrier, so both see the same machine load. Then the pipelined
    pair, alternating the same way: grstack with the next batch's routing and retrieval prefetched in a
    thread (dual buffer), TorchRec's TrainPipelineSparseDist (the next batch's input dist started before the
    current forward). Returns per-step times (ms) and each step's duplicate share."""
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
    w = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    trec = _torchrec_model(env, rows, dim, w) if payload["torchrec"] else None
    batches = _zipf_batches(ctx.rank, steps, payload["seqs"], rows, payload["exponent"])
    duplicate_share = [1.0 - torch.unique(ids).numel() / ids.numel() for ids, _ in batches]
    trec_batches = []
    if trec is not None:
        from torchrec import KeyedJaggedTensor
        from torchrec.datasets.utils import Batch

        trec_batches = [Batch(dense_features=torch.zeros(len(lengths), 1), labels=torch.zeros(len(lengths)),
                              sparse_features=KeyedJaggedTensor(keys=["item"], values=ids, lengths=lengths))
                        for ids, lengths in batches]

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

    def alternate(i: int, *sides: tuple[Any, list[float]] | None) -> None:
        """Times each side's step ``i`` after a barrier (the default group: it also drains TorchRec's
        collectives in flight), in turn; which side goes first alternates with ``i``."""
        todo = [s for s in sides if s is not None]
        for fn, out in todo if i % 2 == 0 else todo[::-1]:
            ctx.world.barrier()
            t0 = time.perf_counter()
            fn(i)
            out.append(1e3 * (time.perf_counter() - t0))

    def grstack_step(i):
        finish(*lookup(batches[i][0], ctx.sparse_fwd))

    def torchrec_step(i):
        loss, _ = trec(trec_batches[i])
        loss.sum().backward()

    ours, theirs = [], []
    for i in range(steps):
        alternate(i, (grstack_step, ours), None if trec is None else (torchrec_step, theirs))

    # pipelined: grstack prefetches the next lookup in a thread; TorchRec's TrainPipelineSparseDist starts
    # the next batch's input dist before the current forward (on CPU its collectives run on gloo's threads)
    box: dict[str, Any] = {"active": None}

    def prefetch(ids):
        box["next"] = lookup(ids, ctx.sparse_pre)

    def grstack_piped_step(i):
        rb, unit, inv = box["next"]
        table.refresh(rb, box["active"])
        th = None
        if i + 1 < steps:
            th = threading.Thread(target=prefetch, args=(batches[i + 1][0],))
            th.start()
        box["active"] = finish(rb, unit, inv)
        if th is not None:
            th.join()

    pipe = None
    if trec is not None and payload["pipeline"]:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipe = TrainPipelineSparseDist(trec, trec.fused_optimizer, torch.device("cpu"))
        feed = iter(trec_batches)

    def torchrec_piped_step(i):
        pipe.progress(feed)

    piped, theirs_piped = [], []
    ctx.world.barrier()
    box["next"] = lookup(batches[0][0], ctx.sparse_fwd)
    for i in range(steps):
        alternate(i, (grstack_piped_step, piped), None if pipe is None else (torchrec_piped_step, theirs_piped))
    return {"grstack": ours, "torchrec": theirs, "grstack_pipelined": piped, "torchrec_pipelined": theirs_piped,
            "ids_per_step": [int(b[0].numel()) for b in batches], "duplicate_share": duplicate_share}


def torchrec_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception:  # ImportError, or a build that does not load against this torch
        return False
    return True


EMBEDDING_WARMUP = 10


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": float(statistics.median(values)), "p10": _pct(values, 0.1), "p90": _pct(values, 0.9)}


def embedding_comparison(quick: bool) -> dict[str, Any]:
    """The embedding-step comparison on 2 gloo ranks: the ``embedding_*`` keys of ``grstack bench train``.

    Each step's time is its slowest rank's (they start together after a barrier); median, p10 and p90 over
    the timed steps (after ``EMBEDDING_WARMUP``). The TorchRec figures are null without torchrec; if its
    pipelined run fails, the plain comparison is kept (and the failure logged)."""
    from grstack.runtime.errors import UserError
    from grstack.runtime.train import call_ranks

    with_torchrec = torchrec_available()
    if not with_torchrec:
        _log("torchrec is not installed: the torchrec figures are null")
    timed = 100 if quick else 300
    payload = {"rows": 1_000_000, "dim": 64, "seqs": 32, "steps": EMBEDDING_WARMUP + timed, "threads": 1,
               "exponent": ZIPF_EXPONENT, "torchrec": with_torchrec, "pipeline": with_torchrec}
    target = "grstack.runtime.bench.train:embedding_rank"
    try:
        res = call_ranks(target, 2, payload)
    except UserError as exc:  # an optional comparison must not sink the benchmark
        if not with_torchrec:
            raise
        _log(f"torchrec comparison with TrainPipelineSparseDist failed ({exc}); retrying without it")
        try:
            res = call_ranks(target, 2, {**payload, "pipeline": False})
        except UserError as exc2:
            _log(f"torchrec comparison failed ({exc2}); measuring grstack alone")
            res = call_ranks(target, 2, {**payload, "torchrec": False, "pipeline": False})

    def side(key: str) -> dict[str, float] | None:
        if not res[0][key]:
            return None
        return _spread([max(r[key][i] for r in res) for i in range(EMBEDDING_WARMUP, payload["steps"])])

    stats = {k: side(k) for k in ("grstack", "torchrec", "grstack_pipelined", "torchrec_pipelined")}

    def medians(a: str, b: str) -> tuple[dict[str, float | None], float | None]:
        ms = {"grstack": stats[a] and stats[a]["median"], "torchrec": stats[b] and stats[b]["median"]}
        return ms, (ms["grstack"] / ms["torchrec"] if ms["torchrec"] else None)

    plain, ratio = medians("grstack", "torchrec")
    piped, ratio_piped = medians("grstack_pipelined", "torchrec_pipelined")
    shares = [s for r in res for s in r["duplicate_share"]]
    ids = [n for r in res for n in r["ids_per_step"]]
    out = {
        "embedding_step_ms": plain,
        "embedding_step_ratio": ratio,
        "embedding_step_ms_pipelined": piped,
        "embedding_step_ratio_pipelined": ratio_piped,
        "embedding_step_spread_ms": {"grstack": stats["grstack"], "torchrec": stats["torchrec"],
                                     "grstack_pipelined": stats["grstack_pipelined"],
                                     "torchrec_pipelined": stats["torchrec_pipelined"]},
        "embedding_ids": {
            "distribution": "zipf", "exponent": ZIPF_EXPONENT, "rows": payload["rows"], "dim": payload["dim"],
            "ids_per_rank_per_step": statistics.mean(ids), "duplicate_share": statistics.mean(shares),
            "duplicate_share_range": [min(shares), max(shares)], "timed_steps": timed,
            "warmup_steps": EMBEDDING_WARMUP,
            "dedup": {"grstack": GRSTACK_DEDUP, "torchrec": TORCHREC_DEDUP if stats["torchrec"] else None},
        },
    }

    def fmt(s: dict[str, float] | None) -> str:
        return "n/a" if s is None else f"{s['median']:.1f} ms (p10 {s['p10']:.1f}, p90 {s['p90']:.1f})"

    _log(f"embedding step on Zipf(s={ZIPF_EXPONENT}) ids, {out['embedding_ids']['ids_per_rank_per_step']:.0f} "
         f"per rank per step, duplicate share {out['embedding_ids']['duplicate_share']:.2f}, {timed} timed steps: "
         f"grstack {fmt(stats['grstack'])}, torchrec {fmt(stats['torchrec'])}; pipelined: grstack "
         f"{fmt(stats['grstack_pipelined'])}, torchrec {fmt(stats['torchrec_pipelined'])}")
    return out


def collectives_run(cfg: Any, world: int, n: int, steps: int) -> dict[str, Any]:
    """The logged run of every pipeline mode: the ``collectives`` and ``host_syncs_per_step`` keys (module
    docstring)."""
    from grstack.runtime.train import audit_collectives, call_ranks

    modes = pipeline_modes(n)
    res = call_ranks("grstack.runtime.train.harness:run_modes", world,
                     {"config": cfg.model_dump(mode="json"), "modes": modes, "steps": steps, "params": False,
                      "comm_log": True, "host_syncs": True})
    per_mode, syncs = {}, {}
    for m in modes:
        runs = [r[m] for r in res]
        per_mode[m] = audit_collectives([r["comm_log"] for r in runs], members=[r["comm_groups"] for r in runs],
                                        meta_inline=runs[0]["backend"] == "gloo")
        counts = [r["host_syncs"] for r in runs[0]["records"] if r.get("host_syncs") is not None]
        syncs[m] = statistics.mean(counts) if counts else None
    counted = {m: v for m, v in syncs.items() if v is not None}
    worst = max(counted, key=counted.__getitem__) if counted else None
    counter = res[0][next(iter(modes))].get("host_syncs_counter")
    return {
        "collectives": {
            "modes": list(modes), "steps": steps, "ranks": world, "backend": res[0]["sync"]["backend"],
            "order_violations": sum(a["order_violations"] for a in per_mode.values()),
            "issuing_threads_per_communicator_max": max(a["issuing_threads_per_communicator_max"]
                                                        for a in per_mode.values()),
            "device_issuing_threads_per_rank_max": max(a["device_order"]["threads_per_rank_max"]
                                                       for a in per_mode.values()),
            "per_mode": per_mode,
        },
        "host_syncs_per_step": {"value": counted[worst] if worst is not None else None, "mode": worst, "counter": counter,
                                "per_mode": syncs, "steps": steps},
    }


def sharded_data_run(cfg: Any, world: int, quick: bool) -> dict[str, Any]:
    """A short training run of ``world`` ranks that each read only their share of a Parquet dataset
    (``data.read: shard``; the synthetic preset written with small row groups), evaluation included: what
    share of all events the busiest reader decoded, and the largest item-table tensor any rank held, as a
    share of the table's rows (the trainer's own accounting, in its summary)."""
    import tempfile
    from pathlib import Path

    from grstack.runtime.data import load_source, write_dataset
    from grstack.runtime.train import train_distributed, with_overrides

    with tempfile.TemporaryDirectory(prefix="grstack-bench-shard-") as tmp:
        data = write_dataset(load_source(cfg.data), Path(tmp) / "data", row_group_size=64 if quick else 256)
        run_cfg = with_overrides(cfg, {"data.format": "parquet", "data.source": str(data), "data.read": "shard",
                                       "data.shuffle_window": 2, "train.epochs": 1, "train.max_steps": 4 if quick else 8,
                                       "train.num_threads": 1, "eval.max_users": 256 if quick else 1024,
                                       "train.checkpoint_every": 0})
        summary = train_distributed(run_cfg, Path(tmp) / "run", nproc=world, progress=False)
    d, dist = summary["data"], summary["distributed"]
    return {"events_read_fraction_max": d["events_read_fraction_max"],
            "table_rows_fraction_max": dist.get("table_rows_fraction_max"),
            "sharded_data": {"preset": cfg.data.source, "ranks": world, "pieces": d["pieces"],
                             "events_total": d["events_total"], "events_read_fraction": d["events_read_fraction"],
                             "cache_peak_pieces": d["cache_peak_pieces"], "steps": summary["steps"],
                             "table_rows_max": dist.get("table_rows_max"),
                             "mean_wait_ratio_measured": dist["mean_wait_ratio_measured"],
                             "mean_imbalance_cost_model": dist["mean_imbalance"]}}


def run(args: argparse.Namespace) -> int:
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
    sharded = sharded_data_run(cfg, world, quick)
    _log(f"sharded data ({world} ranks): the busiest reader decoded {sharded['events_read_fraction_max']:.3f} of the "
         f"events; the largest item-table tensor on a rank: {sharded['table_rows_fraction_max']} of the rows")
    modes = {m: o for m, o in pipeline_modes(n).items() if m in SETTINGS}
    timed_cfg = with_steps(cfg, world, steps + warmup)
    runs = call_ranks("grstack.runtime.train.harness:run_modes", world,
                      {"config": timed_cfg.model_dump(mode="json"), "modes": modes, "steps": steps + warmup})[0]
    short = {m: len(runs[m]["records"]) for m in SETTINGS if len(runs[m]["records"]) != steps + warmup}
    if short:
        raise RuntimeError(f"timed steps per mode {short}, expected {steps + warmup}")
    step_ms = {m: _median_after_warmup([r["step_ms"] for r in runs[m]["records"]], warmup) for m in SETTINGS}
    blocked_ms = {m: _median_after_warmup([r["blocked_comm_ms"] for r in runs[m]["records"]], warmup)
                  for m in SETTINGS}
    fwp = runs["fwp"]["records"][warmup:]
    exposed = sum(r["exposed_comm_ms"] for r in fwp) / max(sum(r["comm_ms"] for r in fwp), 1e-9)
    keys = {k: statistics.mean(r["unique_keys_per_microbatch"] for r in runs[m]["records"])
            for k, m in (("random", "fwp"), ("clustered", "fwp_clustered"))}
    tokens = statistics.mean(r["tokens"] for r in runs["sync"]["records"])
    fastest = min(step_ms, key=step_ms.get)
    _log(f"step ms {step_ms}; fastest {fastest}")
    logged = collectives_run(cfg, world, n, 3 if quick else 6)
    col, hs = logged["collectives"], logged["host_syncs_per_step"]
    _log(f"collectives of {', '.join(col['modes'])} ({col['steps']} logged steps): {col['order_violations']} order "
         f"violations, at most {col['issuing_threads_per_communicator_max']} issuing threads per communicator; host "
         f"syncs per step {hs['value']} ({hs['counter']})")
    out: dict[str, Any] = {
        "imbalance_before": before,
        "imbalance_after": after,
        "imbalance_cost_model": IMBALANCE_COST_MODEL,
        "imbalance_measured": measured,
        "step_ms": step_ms,
        "blocked_comm_ms": blocked_ms,
        "exposed_comm_ratio": exposed,
        "microbatches": n,
        "unique_keys_per_microbatch": keys,
        "cluster_ms_per_batch": clustering["cluster_ms_per_batch"],
        **sharded,
        "clustering": clustering,
        "dbp_max_abs_diff": max_abs_diff(runs["sync"]["params"], runs["dbp"]["params"]),
        "fwp_max_abs_diff": max_abs_diff(runs["dbp"]["params"], runs["fwp"]["params"]),
        "tokens_per_second": tokens / (step_ms[fastest] / 1e3),
        **logged,
        "embedding_step_ms": {"grstack": None, "torchrec": None},
        "embedding_step_ratio": None,
        "embedding_step_ms_pipelined": {"grstack": None, "torchrec": None},
        "embedding_step_ratio_pipelined": None,
        "embedding_step_spread_ms": None,
        "embedding_ids": None,
    }
    if not args.no_embedding:
        out.update(embedding_comparison(quick))
    _log(f"done in {time.perf_counter() - t_start:.0f} s")
    print(json.dumps(out, indent=2))
    return 0

"""``grstack bench mfu``: model FLOPs utilisation of real training steps of the one trainer's engine.

Builds the engine exactly as ``grstack train`` does at world size 1 (the config passes through unchanged:
``train.precision``, ``train.tf32``, ``train.grad_accum_steps`` are the engine's to honour), runs
``--warmup`` steps that are not timed, then ``--steps`` timed steps, each bracketed by a device
synchronisation. Batch preparation (the trainer's background thread) is outside the timed region. Nothing is
written to disk. Prints one JSON object on stdout; progress on stderr. docs/mfu.md.

Model FLOPs are counted from each step's actual jagged batch (real tokens, no padding):

* per HSTU layer and token: ``2·d·H·(2·dv + 2·dqk)`` (the U/V/Q/K projection) + ``2·H·dv·d`` (the output);
* per HSTU layer and attention pair: ``2·H·(dqk + dv)`` (Q·Kᵀ and A·V), on the pairs the mask allows: a
  history token attends to itself and the history before it, each of the ``M`` ranking candidates appended
  after a history of ``h`` tokens to that history and itself: ``h·(h+1)/2 + M·(h+1)`` pairs per sequence;
* per history token, the sampled softmax: ``2·d`` (positive) + ``2·d·K`` (its ``K`` negative logits: ``R``
  shared by the batch, or ``R·share_k`` with per-group/per-token sets and logit sharing);
* per candidate, when the ranking head trains: ``2·(2d)·d + 2·d·T`` (its MLP, ``T`` tasks);
* SASRec: ``2·d·3d + 2·d·d + 2·2·d·(f·d)`` per token and layer, ``4·d`` per causal pair;
* backward = 2 × forward, so a step is 3 × forward; elementwise work (norms, SiLU, biases, the embedding
  gathers, the optimizers) is not counted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grstack.runtime.errors import UserError

FORMULA = (
    "step = 3 x forward (backward = 2 x forward); forward = sum over micro-batches of "
    "HSTU: layers x [tokens x (2 d H (2 dv + 2 dqk) + 2 H dv d) + pairs x 2 H (dqk + dv)] "
    "+ history_tokens x 2 d (1 + negatives_per_token) + candidates x (2 (2d) d + 2 d T) [ranking head]; "
    "SASRec: layers x [tokens x 2 d^2 (4 + 2 ffn_mult) + pairs x 4 d] + history_tokens x 2 d (1 + "
    "negatives_per_token); pairs per sequence = h (h + 1) / 2 + M (h + 1) (h history tokens, M candidates); "
    "tokens = history + candidate tokens, real (jagged) lengths, no padding; elementwise ops ignored")


@dataclass(frozen=True)
class Peak:
    """Dense (no sparsity) peak TFLOP/s of one accelerator, per precision of the matmuls."""

    name: str
    match: tuple[str, ...]  # substrings of the device name (any one matches)
    tflops: dict[str, float]
    source: str


# First match wins: the more specific names come first. NVIDIA figures are the datasheets' dense numbers (the
# "with sparsity" figures halved): H100 SXM / H200 (same Hopper SXM compute): FP32 67, TF32 989 / 2, BF16
# 1979 / 2; H100 PCIe: FP32 51, TF32 756 / 2, BF16 1513 / 2; A100 (SXM and PCIe): FP32 19.5, TF32 156,
# BF16 312.
PEAKS: tuple[Peak, ...] = (
    Peak("NVIDIA H100 PCIe", ("H100 PCIe",), {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2},
         "NVIDIA H100 datasheet (PCIe), dense"),
    Peak("NVIDIA H200", ("H200",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
         "NVIDIA H200 datasheet (SXM), dense; the same compute as H100 SXM"),
    Peak("NVIDIA H100 SXM", ("H100",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
         "NVIDIA H100 datasheet (SXM), dense"),
    Peak("NVIDIA A100", ("A100",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
         "NVIDIA A100 datasheet, dense"),
    # Huawei Ascend 910B2 (torch_npu names it "Ascend910B2", "Ascend910B2C" on some boards): ~376 TFLOP/s
    # FP16/BF16 on the cube units, the figure commonly quoted for the 910B2 variant (Atlas 800T A2 class).
    # Huawei publishes per-variant figures only loosely and public sources disagree (256 to ~414 TFLOP/s
    # across 910B1..B4), so only the B2 is listed: other 910B variants get a null peak rather than a guess.
    Peak("Huawei Ascend 910B2", ("910B2",), {"bf16": 376.0, "fp16": 376.0},
         "commonly quoted FP16/BF16 peak of the Ascend 910B2 (approximate)"),
)


def peak_precision(precision: str, tf32: bool) -> str:
    """Which peak applies: bf16 compute -> the bf16 peak; fp32 with TF32 matmuls -> tf32; else fp32."""
    if precision == "bf16":
        return "bf16"
    return "tf32" if tf32 else "fp32"


def find_peak(device_name: str, precision: str) -> tuple[Peak | None, float | None, str | None]:
    """(table entry, peak TFLOP/s, note). The peak is None, with a note saying why, for a device or a
    precision the table does not hold."""
    for peak in PEAKS:
        if any(m.lower() in device_name.lower() for m in peak.match):
            value = peak.tflops.get(precision)
            if value is None:
                return peak, None, f"no {precision} peak for {peak.name} in the table"
            return peak, value, None
    return None, None, f"no peak TFLOP/s known for {device_name!r}: mfu is null (add it to PEAKS)"


# -- the FLOPs formula ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelDims:
    kind: str  # "hstu" | "fuxi" | "sasrec"
    d_model: int
    num_blocks: int
    num_heads: int
    dqk: int = 0
    dv: int = 0
    ffn_mult: int = 1
    channels: int = 1  # FuXi-α: semantic + positional + temporal channels present

    @classmethod
    def of(cls, model_cfg: Any) -> ModelDims:
        m = model_cfg
        return cls(m.type, m.d_model, m.num_blocks, m.num_heads, m.dqk, m.dv, m.ffn_mult,
                   1 + int(m.position_bias) + int(m.time_bias))


@dataclass
class FlopCount:
    """Forward FLOPs by part, and the sizes they come from; ``step`` is forward + backward."""

    linear: int = 0
    attention: int = 0
    loss: int = 0
    ranking_head: int = 0
    history_tokens: int = 0
    candidate_tokens: int = 0
    attention_pairs: int = 0  # per layer
    sequences: int = 0

    @property
    def forward(self) -> int:
        return self.linear + self.attention + self.loss + self.ranking_head

    @property
    def step(self) -> int:
        return 3 * self.forward

    @property
    def tokens(self) -> int:
        return self.history_tokens + self.candidate_tokens

    def __add__(self, other: FlopCount) -> FlopCount:
        names = ("linear", "attention", "loss", "ranking_head", "history_tokens", "candidate_tokens",
                 "attention_pairs", "sequences")
        return FlopCount(**{n: getattr(self, n) + getattr(other, n) for n in names})


def attention_pairs(hist_lengths: Sequence[int], candidates: int = 0) -> int:
    """Query-key pairs the HSTU mask allows (kernels' reference mask): history token i sees history tokens
    0..i; each of the ``candidates`` tokens after a history of h sees the h history tokens and itself."""
    return sum(h * (h + 1) // 2 + candidates * (h + 1) for h in hist_lengths)


def forward_flops(dims: ModelDims, hist_lengths: Sequence[int], candidates: int = 0,
                  negatives_per_token: int = 0, ranking_tasks: int = 0) -> FlopCount:
    """Forward model FLOPs of one micro-batch: sequences with ``hist_lengths`` history tokens, each followed
    by ``candidates`` ranking candidates; every history token scores one positive and
    ``negatives_per_token`` negatives; ``ranking_tasks`` > 0 when the ranking head trains (T tasks)."""
    d, layers, H = dims.d_model, dims.num_blocks, dims.num_heads
    hist = sum(int(h) for h in hist_lengths)
    cands = candidates * len(hist_lengths)
    tokens = hist + cands
    pairs = attention_pairs([int(h) for h in hist_lengths], candidates)
    if dims.kind == "hstu":
        per_token = 2 * d * H * (2 * dims.dv + 2 * dims.dqk) + 2 * H * dims.dv * d
        per_pair = 2 * H * (dims.dqk + dims.dv)
    elif dims.kind == "fuxi":
        # U (C channels), V, Q, K projection; channels back to d; SwiGLU (three d x ffn_mult·d matmuls)
        C, hv = dims.channels, H * dims.dv
        per_token = 2 * d * (C * hv + hv + 2 * H * dims.dqk) + 2 * C * hv * d + 3 * 2 * d * dims.ffn_mult * d
        # semantic: Q·Kᵀ and A·V; each bias-only channel: A·V (its weights are table look-ups)
        per_pair = 2 * H * (dims.dqk + dims.dv) + (C - 1) * 2 * hv
    elif dims.kind == "sasrec":
        if candidates:
            raise ValueError("SASRec has no ranking candidates")
        per_token = 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * dims.ffn_mult * d
        per_pair = 4 * d  # Q·Kᵀ and A·V over d / H per head, H heads
    else:
        raise ValueError(f"unknown model type {dims.kind!r}")
    head = cands * (2 * 2 * d * d + 2 * d * ranking_tasks) if ranking_tasks else 0
    return FlopCount(linear=layers * tokens * per_token, attention=layers * pairs * per_pair,
                     loss=hist * 2 * d * (1 + negatives_per_token), ranking_head=head, history_tokens=hist,
                     candidate_tokens=cands, attention_pairs=pairs, sequences=len(hist_lengths))


def batch_flops(dims: ModelDims, batch: Any, ranking: bool) -> FlopCount:
    """Forward FLOPs of one PreparedBatch (this rank's micro-batches), from its real jagged lengths."""
    total = FlopCount()
    for mb in batch.micro:
        lengths = mb.full.lengths.tolist()
        m = int(mb.full.num_targets[0]) if mb.full.num_targets is not None and len(lengths) else 0
        hist = [n - m for n in lengths]
        if mb.neg_ids is not None:  # per-group / per-token sets, each token also scores k-1 shared ones
            negs = int(mb.neg_ids.shape[1]) * (1 + len(mb.share))
        else:
            negs = int(batch.batch_neg_ids.numel())
        tasks = int(mb.labels.shape[-1]) if ranking and mb.labels is not None else 0
        total = total + forward_flops(dims, hist, m, negs, tasks)
    return total


def count_parameters(model_cfg: Any, num_items: int, max_len: int, num_tasks: int) -> dict[str, int]:
    """Parameters of ``build_model(model_cfg, num_items, max_len, num_tasks)`` without building it:
    ``item_table`` (the (num_items + 1) x d embedding) and ``dense`` (everything else)."""
    m = model_cfg
    d = m.d_model
    table = (num_items + 1) * d
    if m.type == "hstu":
        seq = max_len + 1  # positions 0..max_len (candidates sit after a full history)
        width = m.num_heads * (2 * m.dv + 2 * m.dqk)
        layer = d * width + width + m.num_heads * m.dv * d + d
        layer += seq if m.position_bias else 0
        layer += m.time_buckets + 1 if m.time_bias else 0
        head = (2 * d * d + d) + (d * num_tasks + num_tasks) if m.ranking_head else 0
        dense = seq * d + m.num_blocks * layer + head
    elif m.type == "fuxi":
        seq = max_len + 1
        C = 1 + int(m.position_bias) + int(m.time_bias)
        hv, hidden = m.num_heads * m.dv, m.ffn_mult * d
        layer = d * (C * hv + hv + 2 * m.num_heads * m.dqk) + (C * hv * d + d) + 3 * d * hidden
        layer += seq if m.position_bias else 0
        layer += m.time_buckets + 1 if m.time_bias else 0
        head = (2 * d * d + d) + (d * num_tasks + num_tasks) if m.ranking_head else 0
        dense = seq * d + m.num_blocks * layer + head
    else:
        f = m.ffn_mult * d
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
        dense = (max_len + 1) * d + m.num_blocks * block + 2 * d
    return {"dense": dense, "item_table": table, "total": dense + table}


# -- the command --------------------------------------------------------------------------------------------------
def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--config", required=True, type=ca.config_file, help="a config file, or a name in configs/")
    parser.add_argument("--device", default=None, help="cpu, cuda[:N], npu[:N] or auto (default: train.device)")
    parser.add_argument("--steps", type=ca.positive_int, default=10, help="timed training steps (default 10)")
    parser.add_argument("--warmup", type=ca.non_negative_int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", type=ca.override,
                        help="override a config field (repeatable)")
    parser.add_argument("--threads", type=ca.positive_int, default=None, help="CPU threads for torch (default: "
                        "train.num_threads, else torch's default)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[bench mfu] {msg}", file=sys.stderr, flush=True)


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return str(torch.npu.get_device_name(device.index or 0))
    return platform.processor() or platform.machine() or "cpu"


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.config_files import config_path
    from grstack.runtime.training_config import load_config

    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: at least one timed step is needed")
    if args.warmup < 0:
        raise UserError(f"--warmup {args.warmup}: must be 0 or more")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads {args.threads}: must be at least 1")
    cfg = load_config(config_path(args.config), args.overrides)

    import torch

    from grstack.runtime.data import LeaveOneOut, load_source
    from grstack.runtime.device import HostSyncCounter, configure_precision, resolve_device, synchronize
    from grstack.runtime.embedding import ShardingPlan
    from grstack.runtime.model import task_names
    from grstack.runtime.train import DistContext, build_engine, with_overrides

    device = resolve_device(args.device or cfg.train.device)
    configure_precision(device, cfg.train.precision, cfg.train.tf32)
    threads = args.threads or cfg.train.num_threads
    if threads:
        torch.set_num_threads(threads)
    total_steps = args.warmup + args.steps
    # exactly warmup + steps positions (one epoch per step at most), whatever the config's length
    cfg = with_overrides(cfg, {"train.device": str(device), "train.epochs": total_steps,
                               "train.max_steps": total_steps})
    t0 = time.perf_counter()
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len)
    if len(split.train_users) == 0:
        raise UserError(f"data.source {cfg.data.source}: no user has the >= 4 events training needs")
    tasks = task_names(ds)
    _log(f"{cfg.name}: {ds.name}, {ds.num_items} items, {len(split.train_users)} training sequences "
         f"({time.perf_counter() - t0:.1f} s)")
    ctx = DistContext.single(device, cfg.distributed.sparse_group_size, cfg.distributed.timeout_s)
    plan = ShardingPlan.make(ds.num_items + 1, cfg.model.d_model, ctx.world_size, ctx.group_size,
                             cfg.distributed.max_shard_rows)
    built = build_engine(cfg, ctx, plan, split, tasks)
    engine, dims = built.engine, ModelDims.of(cfg.model)
    dense = sum(p.numel() for p in built.model.parameters())
    params = {"dense": dense, "item_table": plan.num_rows * plan.dim, "total": dense + plan.num_rows * plan.dim}
    _log(f"{cfg.model.type}: {params['dense']:,} dense + {params['item_table']:,} item-table parameters on "
         f"{device}, precision {cfg.train.precision}; {args.warmup} warm-up + {args.steps} timed steps")
    positions = list(built.schedule.positions(0, 0, 0))
    if len(positions) < total_steps:
        raise UserError(f"{cfg.name}: the schedule has {len(positions)} steps, fewer than --warmup + --steps "
                        f"({total_steps})")
    times: list[float] = []
    counts: list[FlopCount] = []
    sync_counts: list[int] = []  # host syncs per timed step (CUDA's sync debug mode; none on CPU)
    try:
        for i, pos in enumerate(positions):
            batch = built.preparer(*pos)  # the trainer prepares in a background thread: not timed
            synchronize(device)
            t = time.perf_counter()
            with HostSyncCounter(device) as syncs:
                out = engine.step(batch, None, cfg.optim.lr)
            synchronize(device)
            dt = time.perf_counter() - t
            if syncs.count is not None and i >= args.warmup:
                sync_counts.append(syncs.count)
            if not math.isfinite(out["loss"]):
                raise UserError(f"loss is {out['loss']} at step {i + 1}; lower optim.lr")
            if i >= args.warmup:
                times.append(dt)
                counts.append(batch_flops(dims, batch, engine.ranking))
            _log(f"step {i + 1}/{total_steps}{' (warm-up)' if i < args.warmup else ''}: {1e3 * dt:.1f} ms, "
                 f"loss {out['loss']:.4f}")
    finally:
        engine.close()
    per_step = FlopCount()
    for c in counts:
        per_step = per_step + c
    n = len(counts)
    seconds = sum(times)
    flops = per_step.step / n
    achieved = per_step.step / seconds / 1e12
    which = peak_precision(cfg.train.precision, cfg.train.tf32)
    name = _device_name(device)
    entry = peak = note = None
    if device.type == "cpu":
        note = "CPU: no peak table entry; only the achieved FLOP/s is reported"
    else:
        entry, peak, note = find_peak(name, which)
    ms = [1e3 * t for t in times]
    result: dict[str, Any] = {
        "flops_per_step": flops,
        "step_ms": 1e3 * seconds / n,
        "achieved_tflops": achieved,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "step_ms_spread": {"median": statistics.median(ms), "p10": _percentile(ms, 0.1),
                           "p90": _percentile(ms, 0.9), "min": min(ms), "max": max(ms)},
        "flops_per_step_by_part": {k: 3 * getattr(per_step, k) / n
                                   for k in ("linear", "attention", "loss", "ranking_head")},
        "parameters": params,
        "tokens_per_step": per_step.tokens / n,
        "history_tokens_per_step": per_step.history_tokens / n,
        "candidate_tokens_per_step": per_step.candidate_tokens / n,
        "sequences_per_step": per_step.sequences / n,
        "attention_pairs_per_step": per_step.attention_pairs / n,
        "attention_pairs_note": "per layer (every layer attends over the same pairs)",
        "model": {"type": dims.kind, "d_model": dims.d_model, "num_blocks": dims.num_blocks,
                  "num_heads": dims.num_heads, "dqk": dims.dqk, "dv": dims.dv, "ranking_head": engine.ranking},
        "precision": cfg.train.precision,
        "tf32": cfg.train.tf32,
        "peak_precision": which,
        "peak_entry": ({"name": entry.name, "tflops": entry.tflops, "source": entry.source}
                       if entry is not None else None),
        "device": str(device),
        "device_name": name,
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "steps": n,
        "host_syncs_per_step": sum(sync_counts) / len(sync_counts) if sync_counts else None,
        "warmup": args.warmup,
        "config": cfg.name,
        "formula": FORMULA,
        "timing": "each step between device synchronisations; batch preparation (a background thread in "
                  "training) not timed; step_ms = timed seconds / steps",
    }
    if note:
        result["note"] = note
    _log(f"{flops / 1e9:.2f} GFLOP/step, {result['step_ms']:.1f} ms/step, {achieved:.4f} TFLOP/s"
         + (f", MFU {result['mfu']:.3f} of {peak} ({which})" if peak else ""))
    print(json.dumps(result, indent=2))
    return 0

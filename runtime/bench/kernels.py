"""``grstack bench kernels``: jagged vs padded HSTU attention, forward+backward, time and peak memory.

"jagged" is what :func:`grstack.kernels.hstu_attention` runs on the device (CPU: the length-bucketed torch
reference; CUDA: the fused Triton kernels). Two padded baselines compute the same math on a dense
[B, L_max, L_max] layout: ``padded`` (``padded_ms``) is written the way a good engineer would — the time-bucket
indices built once per batch, the position bias one gathered [L, L] table broadcast over the batch, and the
bias-table gradients reduced by ``bincount`` instead of an advanced-index backward over B·L² elements —
and ``padded_naive`` (``padded_naive_ms``) is the kernels' ``padded`` backend with plain autograd, which
rebuilds int64 [B, L, L] bucket tensors on every call. ``speedup`` is against the good one. Each case also
counts the calls one jagged forward+backward makes that would block the host on an accelerator
(``host_syncs``; how, in ``host_syncs_counter``: :mod:`grstack.kernels.host_syncs`; on CUDA also CUDA's sync
debug mode, ``host_syncs_cuda_sync_debug``). Prints one JSON object on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass

from grstack.runtime.errors import UserError

H200_BF16_PEAK_TFLOPS = 989.4  # dense bf16, H200 SXM (as bench mfu)


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the kernels run")
    parser.add_argument("--quick", action="store_true",
                        help="smaller cases (CPU: under a minute); the JSON lists what was left out")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    parser.add_argument("--reps", type=ca.positive_int, default=None,
                        help="timed repetitions per case (default 3, 5 on CUDA)")
    parser.add_argument("--seed", type=ca.seed, default=0, help="seed of the random inputs")
    parser.add_argument("--head-dims", type=ca.positive_int, nargs="+", default=None,
                        help="head sizes to run, the first is the headline (default: 64 16 on CUDA; 16, and 64 "
                             "without --quick, on CPU)")
    parser.add_argument("--compile-report", action="store_true",
                        help="compile every fused kernel configuration for an NVIDIA target (no GPU needed) and "
                             "print registers, spill bytes and shared memory per kernel instead of timing")
    parser.add_argument("--arch", type=ca.positive_int, default=90, help="--compile-report: compute capability (90: H100/H200)")
    parser.add_argument("--workers", type=ca.positive_int, default=2, help="--compile-report: compiler processes")
    parser.add_argument("--threads", type=ca.positive_int, default=1,
                        help="CPU threads for torch (default 1: on a shared machine more threads make OpenMP "
                             "barriers wait for descheduled workers, which distorts many-small-op timings)")
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _cases(device: str, quick: bool, seed: int):
    """(name, lengths, num_targets or None). kuairand-like: log-normal lengths, mean << max, one at max."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if device == "cuda":
        kr_batch, kr_max, kr_median = (32, 2048, 300) if quick else (32, 4096, 300)
        fixed = (512, 1024, 2048, 4096) if quick else (512, 1024, 2048, 4096, 8192)
        tokens = 16384 if quick else 32768
    else:
        kr_batch, kr_max, kr_median = (32, 512, 60) if quick else (32, 1024, 100)
        fixed = (512, 1024, 2048) if quick else (512, 1024, 2048, 4096, 8192)
        tokens = 2048 if quick else 4096
    lengths = torch.exp(torch.randn(kr_batch, generator=g) * 1.1 + math.log(kr_median))
    lengths = lengths.round().clamp(4, kr_max).long()
    lengths[0] = kr_max
    yield "kuairand-like", lengths.tolist()
    for length in fixed:
        yield f"fixed-{length}", [length] * max(1, tokens // length)


def _inputs(lengths: list[int], device, dtype, heads: int, dqk: int, dv: int, max_seq_len: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
    n = int(offsets[-1])
    q, k = (0.3 * torch.randn(n, heads, dqk, generator=g) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=g)
    ts = torch.cumsum(torch.randint(0, 3600, (n,), generator=g), 0)
    pos_w = 0.02 * torch.randn(max_seq_len, generator=g)
    time_w = 0.02 * torch.randn(129, generator=g)
    grad = torch.randn(n, heads, dv, generator=g)
    to = dict(device=device)
    return dict(q=q.to(dtype=dtype, **to), k=k.to(dtype=dtype, **to), v=v.to(dtype=dtype, **to),
                offsets=offsets.to(**to), timestamps=ts.to(**to), pos_weight=pos_w.to(**to),
                time_weight=time_w.to(**to), grad=grad.to(dtype=dtype, **to), max_seq_len=max_seq_len,
                lengths=list(lengths))


class _GatherBincount:
    """``table[idx]`` whose backward reduces into the table with ``bincount`` (one pass over the index, no
    sort-and-accumulate of an advanced-index backward)."""

    @staticmethod
    def apply(table, idx):
        import torch

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, i):
                ctx.save_for_backward(i)
                ctx.n = t.numel()
                return t[i]

            @staticmethod
            def backward(ctx, grad):
                (i,) = ctx.saved_tensors
                g = torch.bincount(i.reshape(-1), weights=grad.reshape(-1).double(), minlength=ctx.n)
                return g.to(grad.dtype), None

        return Fn.apply(table, idx)


def padded_prep(inp: dict) -> dict:
    """What a padded implementation builds once per batch (and reuses in every layer): lengths, the [L, L]
    position-distance index and the [B, L, L] time-bucket index."""
    import torch

    from grstack.kernels import time_buckets

    offsets = inp["offsets"]
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    L = max(lengths)
    ar = torch.arange(L, device=offsets.device)
    dist = (ar[:, None] - ar[None, :]).clamp(0, inp["pos_weight"].numel() - 1)
    ts = torch.zeros(len(lengths), L, dtype=inp["timestamps"].dtype, device=offsets.device)
    for b, n in enumerate(lengths):
        ts[b, :n] = inp["timestamps"][int(offsets[b]):int(offsets[b]) + n]
    buckets = time_buckets(ts[:, :, None] - ts[:, None, :], inp["time_weight"].numel() - 1)
    causal = (ar[:, None] >= ar[None, :])
    return {"lengths": lengths, "L": L, "dist": dist, "buckets": buckets, "causal": causal}


def _padded_good(q, k, v, inp: dict, prep: dict, pw, tw):
    """Dense attention with the per-batch indices reused and the bias tables' gradients by bincount."""
    import torch
    import torch.nn.functional as F

    lengths, L = prep["lengths"], prep["L"]
    B = len(lengths)

    def pad(x):
        out = x.new_zeros(B, L, *x.shape[1:])
        off = 0
        for b, n in enumerate(lengths):
            out[b, :n] = x[off:off + n]
            off += n
        return out

    qp, kp, vp = pad(q), pad(k), pad(v)  # [B, L, H, d]
    scores = torch.matmul(qp.permute(0, 2, 1, 3), kp.permute(0, 2, 3, 1))  # [B, H, L, L]
    if pw is not None:
        bias = _GatherBincount.apply(pw, prep["dist"])[None] + _GatherBincount.apply(tw, prep["buckets"])
        scores = scores + bias.unsqueeze(1).to(scores.dtype)  # [B, L, L] broadcast over heads
    attn = F.silu(scores) * (prep["causal"].to(scores.dtype) / inp["max_seq_len"])
    out = torch.matmul(attn, vp.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)  # [B, L, H, dv]
    return torch.cat([out[b, :n] for b, n in enumerate(lengths)])


@dataclass(frozen=True)
class Variant:
    """What one timed step computes: with or without the two bias tables, their gradients, the backward."""

    name: str
    bias: bool = True
    table_grads: bool = True
    backward: bool = True


FULL = Variant("fwd+bwd, bias, table grads")
VARIANTS = (FULL, Variant("fwd+bwd, bias, frozen tables", table_grads=False),
            Variant("fwd+bwd, no bias", bias=False, table_grads=False),
            Variant("fwd, bias", table_grads=False, backward=False),
            Variant("fwd, no bias", bias=False, table_grads=False, backward=False))


def _step(impl: str, inp: dict, plan=None, variant: Variant = FULL):
    """One step of ``variant`` (forward+backward by default); returns the output (detached). ``plan``: the
    jagged plan, or the padded baseline's per-batch indices (built here when not given: each step pays its
    per-batch preparation)."""
    import torch

    from grstack.kernels import hstu_attention, make_plan

    with torch.set_grad_enabled(variant.backward):
        q, k, v = (inp[n].detach().requires_grad_(variant.backward) for n in ("q", "k", "v"))
        pw, tw = (inp[n].detach().requires_grad_(variant.backward and variant.table_grads)
                  for n in ("pos_weight", "time_weight"))
        if not variant.bias:
            pw = tw = None
        kw = dict(max_seq_len=inp["max_seq_len"], timestamps=inp["timestamps"], pos_weight=pw, time_weight=tw)
        if impl == "padded":
            out = _padded_good(q, k, v, inp, plan if plan is not None else padded_prep(inp), pw, tw)
        elif impl == "padded_naive":
            out = hstu_attention(q, k, v, inp["offsets"], backend="padded", **kw)
        else:
            if q.device.type == "cpu" and plan is None:
                plan = make_plan(inp["offsets"], lengths=inp["lengths"])
            out = hstu_attention(q, k, v, inp["offsets"], plan=plan, **kw)
        if variant.backward:
            out.backward(inp["grad"])
    return out.detach()


def count_host_syncs(fn, device: str = "cpu") -> int:
    """The calls in ``fn`` that block the host on an accelerator, by :mod:`grstack.kernels.host_syncs` (its
    ``HOST_SYNC_METHOD`` is the JSON's ``host_syncs_counter``): scalar reads (``.item``, ``int(t)``, ``bool(t)``...),
    data-dependent shapes (``nonzero``, bool-mask indexing, ``unique``...), blocking cross-device copies and
    ``.cpu``/``.tolist``/``.numpy``, on tensors of ``device``."""
    from grstack.kernels import count_host_syncs as count

    return count(fn, device)


def _cuda_sync_debug_count(fn) -> int | None:
    """What CUDA's sync debug mode reports for ``fn`` (the exact figure on CUDA)."""
    import torch

    from grstack.runtime.device import HostSyncCounter

    torch.cuda.synchronize()
    with HostSyncCounter(torch.device("cuda")) as counter:
        fn()
    return counter.count


def _time_ms(fn, reps: int, cuda: bool) -> float:
    import torch

    fn()  # warm-up: Triton compilation, allocator, caches
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cpu_peak_bytes(fn) -> int:
    """Peak of live CPU tensor bytes allocated during ``fn`` above what was live before it.

    The torch profiler reports every allocation and free of the CPU allocator (``profile_memory=True``);
    the running sum of those events, in time order, is the live-bytes curve, and its maximum is the peak.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _cuda_peak_bytes(fn) -> int:
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def attention_flops(lengths: list[int], heads: int, dqk: int, dv: int) -> int:
    """Matmul FLOPs of forward+backward over the allowed (causal) pairs only.

    Per allowed pair and head: forward Q·Kᵀ and A·V (2·dqk + 2·dv); backward dA = dO·Vᵀ, dV = Aᵀ·dO,
    dQ = dS·K, dK = dSᵀ·Q (4·dv + 4·dqk). Recomputation inside a kernel is not counted.
    """
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return pairs * heads * 6 * (dqk + dv)


def compile_report(arch: int, quick: bool, workers: int) -> dict:
    """Runs :mod:`grstack.kernels.triton_aot` in a subprocess (the kernels must be imported without
    ``TRITON_INTERPRET``) and collects its records; progress on stderr."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-P", "-m", "grstack.kernels.triton_aot", "--arch", str(arch), "--workers",
           str(max(1, workers))] + (["--quick"] if quick else [])
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    records = []
    for line in proc.stdout:
        rec = json.loads(line)
        records.append(rec)
        cfg = rec["config"]
        _log(f"  {rec['kernel']} d={cfg.get('block_dqk', '-')} {'+'.join(cfg['features']) or 'plain'} "
             f"tile {cfg.get('block_m', '-')}x{cfg.get('block_n', '-')} warps {cfg['num_warps']}: "
             f"{rec['n_regs']} registers, {rec['n_spills']} B spilled")
    err = proc.stderr.read()
    if proc.wait() != 0:
        tail = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        raise UserError(f"--compile-report: compiling for sm_{arch} failed: {tail}")
    return {"compile": records, "target": f"sm_{arch}", "quick": quick,
            "spill_free": all(r["n_spills"] == 0 and r["spill_load_bytes"] == 0 for r in records),
            "seconds": round(time.perf_counter() - start, 1)}


def _variants(inp: dict, lengths: list[int], heads: int, d: int, reps: int, cuda: bool) -> list[dict]:
    """The same batch without bias-table gradients, without bias, and forward only, fused against padded."""
    out = []
    for variant in VARIANTS[1:]:
        jagged_ms = _time_ms(lambda v=variant: _step("jagged", inp, variant=v), reps, cuda)
        padded_ms = _time_ms(lambda v=variant: _step("padded", inp, variant=v), reps, cuda)
        row = {"variant": variant.name, "bias": variant.bias, "table_grads": variant.table_grads,
               "backward": variant.backward, "jagged_ms": round(jagged_ms, 3), "padded_ms": round(padded_ms, 3),
               "speedup": round(padded_ms / jagged_ms, 3)}
        if cuda:
            flops = attention_flops(lengths, heads, d, d) // (1 if variant.backward else 3)
            row["jagged_tflops"] = round(flops / jagged_ms / 1e9, 2)
            row["jagged_share_of_peak"] = round(flops / jagged_ms / 1e9 / H200_BF16_PEAK_TFLOPS, 4)
        _log(f"  {variant.name}: jagged {jagged_ms:.1f} ms, padded {padded_ms:.1f} ms, {row['speedup']}x")
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if args.compile_report:
        try:
            import triton.backends.nvidia  # noqa: F401
        except ImportError as exc:
            raise UserError("--compile-report needs Triton's NVIDIA backend (pip install triton)") from exc
        print(json.dumps(compile_report(args.arch, args.quick, args.workers)))
        return 0

    from grstack.kernels import HOST_SYNC_METHOD, make_plan, select_backend

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if args.reps is not None and args.reps < 1:
        raise UserError(f"--reps must be >= 1, got {args.reps}")
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if not cuda:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = 4
    # the headline head size first: d=64 on accelerators (the kernels' main target), d=16 on CPU (the
    # KuaiRand-27K configs' size); the other one after it
    dims = tuple(args.head_dims) if args.head_dims else (64, 16) if cuda else ((16,) if args.quick else (16, 64))
    if any(d < 1 for d in dims):
        raise UserError(f"--head-dims must be positive, got {list(dims)}")
    dqk = dv = dims[0]
    reps = args.reps or (5 if cuda else 3)
    backend = select_backend(device)
    cases = []
    for d, (name, lengths) in ((d, c) for d in dims for c in _cases(args.device, args.quick, args.seed)):
        max_seq_len = max(lengths) + 1
        inp = _inputs(lengths, device, dtype, heads, d, d, max_seq_len, args.seed)
        if d != dims[0]:
            name = f"{name}@d{d}"
        _log(f"{name}: {len(lengths)} sequences, {sum(lengths)} tokens, max {max(lengths)}, d={d}")
        jagged = _step("jagged", inp)
        padded = _step("padded", inp)
        naive = _step("padded_naive", inp)
        diff = float((jagged.float() - padded.float()).abs().max())
        diff_naive = float((jagged.float() - naive.float()).abs().max())
        del jagged, padded, naive
        slow = max(lengths) >= 4096 and not cuda
        jagged_ms = _time_ms(lambda inp=inp: _step("jagged", inp), 1 if slow else reps, cuda)
        padded_ms = _time_ms(lambda inp=inp: _step("padded", inp), 1 if slow else reps, cuda)
        naive_ms = _time_ms(lambda inp=inp: _step("padded_naive", inp), 1 if slow else reps, cuda)
        peak = _cuda_peak_bytes if cuda else _cpu_peak_bytes
        jagged_peak = peak(lambda inp=inp: _step("jagged", inp))
        padded_peak = peak(lambda inp=inp: _step("padded", inp))
        syncs = count_host_syncs(lambda inp=inp: _step("jagged", inp), args.device)
        case = {
            "name": name, "device": args.device, "backend": backend, "d": d,
            "lengths": {"batch": len(lengths), "tokens": sum(lengths), "mean": round(sum(lengths) / len(lengths), 1),
                        "max": max(lengths)},
            "jagged_ms": round(jagged_ms, 3), "padded_ms": round(padded_ms, 3),
            "padded_naive_ms": round(naive_ms, 3),
            "speedup": round(padded_ms / jagged_ms, 3), "speedup_vs_naive": round(naive_ms / jagged_ms, 3),
            "host_syncs": syncs,
            **({"host_syncs_cuda_sync_debug": _cuda_sync_debug_count(lambda inp=inp: _step("jagged", inp))}
               if cuda else {}),
            "jagged_peak_bytes": jagged_peak, "padded_peak_bytes": padded_peak,
            "memory_ratio": round(padded_peak / max(1, jagged_peak), 3),
            "padded_over_jagged_pairs": round(len(lengths) * max(lengths) ** 2 / sum(n * n for n in lengths), 3),
            "max_abs_diff": diff, "max_abs_diff_naive": diff_naive,
        }
        if not cuda:
            plan = make_plan(inp["offsets"], lengths=lengths)
            case["jagged_ms_plan_reused"] = round(
                _time_ms(lambda inp=inp, plan=plan: _step("jagged", inp, plan), 1 if slow else reps, False), 3)
        else:
            flops = attention_flops(lengths, heads, d, d)
            case["flops"] = flops
            case["jagged_tflops"] = round(flops / jagged_ms / 1e9, 2)
            case["padded_tflops"] = round(flops / padded_ms / 1e9, 2)
            case["padded_naive_tflops"] = round(flops / naive_ms / 1e9, 2)
            case["jagged_share_of_peak"] = round(flops / jagged_ms / 1e9 / H200_BF16_PEAK_TFLOPS, 4)
        _log(f"  jagged {jagged_ms:.1f} ms, padded {padded_ms:.1f} ms (naive {naive_ms:.1f}), speedup "
             f"{case['speedup']}x, host syncs {syncs}, "
             f"memory {jagged_peak / 2**20:.1f} MiB vs {padded_peak / 2**20:.1f} MiB")
        case["variants"] = [] if slow else _variants(inp, lengths, heads, d, reps, cuda)
        cases.append(case)
        del inp
    result = {
        "cases": cases,
        "quick": args.quick,
        "dtype": str(dtype).removeprefix("torch."),
        "heads": heads, "dqk": dqk, "dv": dv, "head_dims": list(dims),
        "cpu_threads": torch.get_num_threads(),
        "bias": "relative position + log time buckets (129), causal, no candidates",
        "timing_method": ("median of reps after one warm-up; each case's headline fields are forward+backward "
                          "with both bias tables and their gradients, its variants drop the table gradients, the "
                          "bias, or the backward; CPU jagged_ms includes building the plan for the batch, "
                          "jagged_ms_plan_reused is a later layer reusing it" + (
                              "; CUDA synchronized around each rep" if cuda else "")),
        "host_syncs_counter": HOST_SYNC_METHOD + ("; host_syncs_cuda_sync_debug: CUDA's sync debug mode" if cuda
                                                   else ""),
        "memory_method": ("torch.cuda.max_memory_allocated above the bytes allocated before the step" if cuda else
                          "torch profiler (profile_memory=True): peak of the running sum of CPU allocator "
                          "alloc/free events during one forward+backward, above what was live before it"),
    }
    if args.quick:
        left_out = "8192" if cuda else "4096 and 8192"
        result["note"] = (f"quick mode: smaller kuairand-like batch and fixed lengths up to "
                          f"{max(c['lengths']['max'] for c in cases if c['name'].startswith('fixed'))}; "
                          f"fixed lengths {left_out} left out")
    if cuda:
        from grstack.kernels import tuned_configs

        result["peak_tflops_bf16"] = H200_BF16_PEAK_TFLOPS
        result["gpu"] = torch.cuda.get_device_name()
        result["tuned"] = tuned_configs()
    print(json.dumps(result))
    return 0

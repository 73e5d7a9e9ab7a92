"""``grstack bench relay-engine``: the serving engine's compute on one device, without HTTP or queues.

Per prefix length it times, side by side in one process (medians of ``--repeats``, device synchronised):
a whole-prefix chunked prefill, as the cache keeps it (plain per-prefix tensors grown per chunk) and written
in place into a KV arena; one batch of ``--batch`` cached ranks (``--short`` short-term events and
``--candidates`` candidates each) against plain prefixes and against arena views; and one full-inference
rank (no cache). It checks the cached scores against full inference (``HSTU.encode``) and, on CUDA, reports
peak device memory. This is where the accelerator path (fused Triton prefix attention, the arena's in-place
addressing) is measured: ``bench/gpu_check.sh`` runs it on CUDA. The model is an untrained HSTU (latency
does not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUICK_LENGTHS = [512, 1024, 2048]
LENGTHS = [1024, 4096, 8192]
CHECK_MAX_LENGTH_CPU = 2048  # full-sequence reference scores above this are slow on CPU


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default auto)")
    parser.add_argument("--lengths", default=None, help="comma-separated prefix lengths (default 1024,4096,8192; "
                                                        "--quick 512,1024,2048)")
    parser.add_argument("--batch", type=ca.positive_int, default=16, help="cached ranks per batch (default 16)")
    parser.add_argument("--candidates", type=ca.positive_int, default=64, help="candidates per rank")
    parser.add_argument("--short", type=ca.positive_int, default=16, help="short-term events per rank (default 16)")
    parser.add_argument("--repeats", type=ca.positive_int, default=5, help="timed repetitions per point")
    parser.add_argument("--threads", type=ca.positive_int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="short lengths (a CPU smoke run)")
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[bench relay-engine] {msg}", file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any], device: Any, repeats: int) -> tuple[float, Any]:
    """Median milliseconds of ``repeats`` calls after one warm-up call; returns the last result too."""
    from grstack.runtime.device import synchronize

    out = fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _peak(device: Any, fn: Callable[[], Any]) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def measure(length: int, *, eng: Any, arena_cls: Any, batch: int, candidates: int, short: int, repeats: int,
            check: bool, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng([seed, length])
    model = eng.model
    reqs = []
    for _ in range(batch):
        n = length + short
        items = rng.integers(1, model.num_items + 1, n)
        ts = 1_600_000_000 + np.cumsum(rng.integers(1, 3600, n))
        cands = rng.integers(1, model.num_items + 1, candidates)
        reqs.append(eng.canonical(items[:length], ts[:length], items[length:], ts[length:], cands, int(ts[-1]) + 1))
    head = reqs[0]
    arena = arena_cls(model, length * (batch + 1), backend=eng.backend)

    def arena_prefill() -> Any:
        block = arena.alloc(length)
        try:
            return eng.prefill(head.long_items, head.long_ts, into=arena.prefix(block))
        finally:
            arena.release(block)

    prefill_ms, _ = _timed(lambda: eng.prefill(head.long_items, head.long_ts), eng.device, repeats)
    prefill_arena_ms, _ = _timed(arena_prefill, eng.device, repeats)
    plain = [eng.prefill(r.long_items, r.long_ts) for r in reqs]
    views = []
    for r in reqs:
        block = arena.alloc(length)
        views.append(eng.prefill(r.long_items, r.long_ts, into=arena.prefix(block)))
    cached_ms, logits = _timed(lambda: eng.rank_cached(plain, reqs), eng.device, repeats)
    cached_arena_ms, logits_arena = _timed(lambda: eng.rank_cached(views, reqs), eng.device, repeats)
    full_ms, _ = _timed(lambda: eng.rank_full([head]), eng.device, max(1, repeats // 2))
    out: dict[str, Any] = {
        "length": length, "batch": batch, "prefill_ms": prefill_ms, "prefill_arena_ms": prefill_arena_ms,
        "rank_cached_batch_ms": cached_ms, "rank_cached_batch_arena_ms": cached_arena_ms,
        "rank_full_ms": full_ms, "cached_per_request_ms": cached_ms / batch,
        "full_over_cached_per_request": full_ms / (cached_ms / batch) if cached_ms > 0 else None,
        "arena_vs_plain_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(logits, logits_arena,
                                                                                     strict=True)),
        "peak_bytes_prefill": _peak(eng.device, lambda: eng.prefill(head.long_items, head.long_ts)),
        "peak_bytes_prefill_arena": _peak(eng.device, arena_prefill),
        "peak_bytes_rank_cached": _peak(eng.device, lambda: eng.rank_cached(plain, reqs)),
        "peak_bytes_rank_cached_arena": _peak(eng.device, lambda: eng.rank_cached(views, reqs)),
        "max_abs_score_diff": None,
    }
    if check:
        ref = eng.rank_encode(reqs[:2])
        out["max_abs_score_diff"] = max(float((a.float() - b.float()).abs().max())
                                        for a, b in zip(ref, logits[:2], strict=True))
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from grstack.runtime.device import resolve_device
    from grstack.runtime.errors import UserError
    from grstack.runtime.serve import KVArena, RelayEngine, load_ranking_model, write_untrained_model

    text = args.lengths or ",".join(str(x) for x in (QUICK_LENGTHS if args.quick else LENGTHS))
    try:
        lengths = sorted(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--lengths: expected comma-separated integers, got {text!r}") from None
    for flag, ok in (("--lengths", bool(lengths) and min(lengths) >= 1), ("--batch", args.batch >= 1),
                     ("--candidates", args.candidates >= 1), ("--short", args.short >= 1),
                     ("--repeats", args.repeats >= 1), ("--threads", args.threads >= 1)):
        if not ok:
            raise UserError(f"{flag}: must be positive")
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    max_len = max(lengths) + args.short + 1
    with tempfile.TemporaryDirectory() as tmp:
        path = write_untrained_model(Path(tmp) / "model.pt", num_items=20_000, max_len=max_len)
        model, _ = load_ranking_model(path)
    eng = RelayEngine(model, device=device, max_suffix=args.short + 1)
    _log(f"device {device} (attention backend {eng.backend}); untrained HSTU d=64, 2 blocks, 2 heads, max_len "
         f"{max_len}; lengths {lengths}, batch {args.batch}, {args.candidates} candidates, {args.repeats} repeats")
    cases = []
    for length in lengths:
        check = device.type != "cpu" or length <= CHECK_MAX_LENGTH_CPU
        c = measure(length, eng=eng, arena_cls=KVArena, batch=args.batch, candidates=args.candidates,
                    short=args.short, repeats=args.repeats, check=check)
        cases.append(c)
        _log(f"length {length:5d}: prefill {c['prefill_ms']:.2f} ms (arena {c['prefill_arena_ms']:.2f}), "
             f"{args.batch} cached ranks {c['rank_cached_batch_ms']:.2f} ms (arena "
             f"{c['rank_cached_batch_arena_ms']:.2f}), full rank {c['rank_full_ms']:.2f} ms, "
             f"max |diff| {c['max_abs_score_diff']}")
    result = {"device": str(device), "backend": eng.backend,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "model": {"d_model": 64, "num_blocks": 2, "num_heads": 2, "dqk": 32, "dv": 32, "max_len": max_len},
              "cases": cases}
    print(json.dumps(result))
    return 0

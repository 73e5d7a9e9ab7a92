"""Compile every Triton kernel for an NVIDIA target without a GPU, with each kernel's register report.

The interpreter accepts programs the GPU compiler rejects (and vice versa), so this lowers each kernel,
in the configurations it runs with, through Triton's real pipeline to PTX and a cubin (Triton ships
ptxas) and reads ptxas' resource report (registers, spill bytes) for the cubin. The attention kernels are
compiled at every tile configuration :mod:`grstack.kernels.triton_tuning` may pick, for head sizes 16, 32,
64 and 128, with no features and with all of them (position and time bias, candidates, a cached prefix,
bias-table gradients). It needs ``TRITON_INTERPRET`` unset at import; ``grstack bench kernels
--compile-report`` runs it in a subprocess. Prints one JSON line per compiled configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from grstack.kernels import triton_embedding, triton_hstu, triton_norm, triton_tuning
from grstack.kernels.triton_util import is_interpreted

_PTR = {
    **dict.fromkeys(["Q", "K", "V", "KP", "VP", "OUT", "DO", "DQ", "DK", "DV"], "*{dt}"),
    **dict.fromkeys(["X", "U", "Y", "G", "DX", "DU", "TABLE", "GRAD"], "*{dt}"),
    **dict.fromkeys(["seq_offsets", "prefix_starts", "prefix_lengths", "num_targets", "TS", "TSQ", "TSP", "IDS"],
                    "*i64"),
    **dict.fromkeys(["pos_w", "time_w", "DPOS_PART", "DPOS_SCAL", "DTIME_PART", "W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART",
                     "DTABLE"], "*fp32"),
    **dict.fromkeys(["tile_seq", "tile_blk"], "*i32"),
}
_FLOATS = {"inv_n", "eps"}
_ATTENTION = {"_hstu_fwd": "fwd", "_hstu_bwd_kv": "bwd_kv", "_hstu_bwd_q": "bwd_q"}
HEAD_DIMS = (16, 32, 64, 128)


def _signature(fn, constexprs: dict, dtype: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _PTR:
            sig[name] = _PTR[name].format(dt=dtype)
        else:
            sig[name] = "fp32" if name in _FLOATS else "i32"
    return sig


def _attention_configs(quick: bool) -> Iterator[tuple[str, str, dict, triton_tuning.TileConfig]]:
    """(kernel name, dtype, constexprs, tile config) for every candidate the tuner may pick."""
    dims = (64,) if quick else HEAD_DIMS
    # no features; every feature; (dK/dV only) both biases with frozen tables; (forward and dK/dV) FuXi-α's
    # bias-only channel (no q·k) with every feature
    variants = [("all", True, True)] if quick else [("none", False, False), ("all", True, True),
                                                   ("frozen", True, False), ("channel", True, True)]
    for d in dims:
        for label, full, grads in variants:
            common = dict(UPCAST=False, TB_DIV=triton_hstu.TIME_BUCKET_DIV, HAS_TARGETS=full, HAS_POS=full,
                          HAS_TIME=full, BLOCK_DQK=d, BLOCK_DV=d, PRECISION="tf32")
            semantic = label != "channel"
            extra = {"_hstu_fwd": dict(HAS_PREFIX=full, SEMANTIC=semantic),
                     "_hstu_bwd_kv": dict(POS_GRAD=grads, TIME_GRAD=grads, BLOCK_TB=256, SEMANTIC=semantic),
                     "_hstu_bwd_q": {}}
            for name, kind in _ATTENTION.items():
                if (label == "frozen" and kind != "bwd_kv") or (label == "channel" and kind == "bwd_q"):
                    continue
                features = tuple(k for k, v in {**common, **extra[name]}.items() if v is True)
                for cfg in triton_tuning.candidates(kind, d, features):
                    yield name, "bf16", dict(common, **extra[name], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n), cfg


def _other_configs() -> Iterator[tuple[str, str, dict, triton_tuning.TileConfig]]:
    four = triton_tuning.TileConfig(0, 0, 4, 3)
    for dtype in ("bf16", "fp32"):
        norm = dict(HAS_W=True, HAS_B=True, BLOCK_R=triton_norm._row_block(256), BLOCK_D=256)
        yield "_ln_mul_fwd", dtype, norm, four
        yield "_ln_mul_bwd", dtype, norm, four
        yield "_gather_fwd", dtype, dict(BLOCK_T=16, BLOCK_D=64), four
        yield "_gather_bwd", dtype, dict(BLOCK_T=16, BLOCK_D=64), four


def _kernel(name: str):
    for module in (triton_hstu, triton_norm, triton_embedding):
        if hasattr(module, name):
            return getattr(module, name)
    raise KeyError(name)


def _ptxas_report(ptx: str, arch: int) -> dict:
    """Registers and spill bytes from ptxas' verbose report, with the flags Triton compiles with."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        proc = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", proc.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
    return {"n_regs": int(regs.group(1)) if regs else None,
            "n_spills": int(spills.group(1)) if spills else 0,
            "spill_load_bytes": int(spills.group(2)) if spills else 0}


def compile_one(job: tuple[str, str, dict, tuple[int, int, int, int]], arch: int = 90) -> dict:
    """Compiles one kernel configuration for ``sm_<arch>`` and returns its record."""
    name, dtype, constexprs, (_, _, warps, stages) = job
    fn = _kernel(name)
    consts = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn, consts, dtype), constexprs=consts),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    features = sorted(k.lower() for k, v in consts.items() if v is True and k not in ("UPCAST", "SEMANTIC"))
    if consts.get("SEMANTIC") is False:
        features.append("bias_channel")
    config = {"dtype": dtype, "num_warps": warps, "num_stages": stages, "features": features,
              **{k.lower(): v for k, v in consts.items() if k.startswith("BLOCK_")}}
    return {"kernel": name, "config": config, "target": f"sm_{arch}",
            **_ptxas_report(ptx, arch), "shared_bytes": compiled.metadata.shared,
            "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx,
            "seconds": round(time.perf_counter() - start, 2)}


def jobs(quick: bool = False) -> list[tuple[str, str, dict, tuple[int, int, int, int]]]:
    out = []
    for name, dtype, consts, cfg in [*_attention_configs(quick), *([] if quick else _other_configs())]:
        out.append((name, dtype, consts, (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)))
    return out


def compile_all(arch: int = 90, quick: bool = False, workers: int = 1) -> Iterator[dict]:
    """Yields one record per compiled kernel configuration; raises on the first compile error."""
    todo = jobs(quick)
    if workers <= 1:
        for job in todo:
            yield compile_one(job, arch)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(compile_one, todo, [arch] * len(todo))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--quick", action="store_true",
                        help="only the attention kernels at head size 64 with every feature on")
    parser.add_argument("--workers", type=int, default=1, help="compile in this many processes")
    args = parser.parse_args(argv)
    if is_interpreted(triton_hstu._hstu_fwd):
        print("error: TRITON_INTERPRET is set; unset it to compile for a GPU", file=sys.stderr)
        return 2
    for record in compile_all(args.arch, args.quick, args.workers):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

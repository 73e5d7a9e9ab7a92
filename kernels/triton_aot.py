"""Compile every Triton kernel for an NVIDIA target without a GPU (``python -m grstack.kernels.triton_aot``).

The interpreter accepts programs the GPU compiler rejects (and vice versa), so this lowers each kernel,
in its main constexpr configurations, through Triton's real pipeline to PTX and a cubin (Triton ships
ptxas). It needs ``TRITON_INTERPRET`` unset at import. Prints one JSON line per kernel configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from grstack.kernels import triton_embedding, triton_hstu, triton_norm
from grstack.kernels.triton_util import is_interpreted

_PTR = {
    **dict.fromkeys(["Q", "K", "V", "KP", "VP", "OUT", "DO", "DQ", "DK", "DV"], "*{dt}"),
    **dict.fromkeys(["X", "U", "Y", "G", "DX", "DU", "TABLE", "GRAD"], "*{dt}"),
    **dict.fromkeys(["seq_offsets", "prefix_starts", "prefix_lengths", "num_targets", "TS", "TSP", "IDS"], "*i64"),
    **dict.fromkeys(["pos_w", "time_w", "DPOS", "DTIME", "W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART",
                     "DTABLE"], "*fp32"),
    **dict.fromkeys(["tile_seq", "tile_blk"], "*i32"),
}
_FLOATS = {"inv_n", "eps"}


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


def _configs(quick: bool):
    attn = dict(UPCAST=False, TB_DIV=triton_hstu.TIME_BUCKET_DIV, BLOCK_M=64)
    variants = [("bf16", 64, True)] if quick else list(
        itertools.product(("bf16", "fp32"), (64, 128), (True, False)))
    for dtype, d, full in variants:
        common = dict(attn, HAS_TARGETS=full, HAS_POS=full, HAS_TIME=full, BLOCK_DQK=d, BLOCK_DV=d,
                      PRECISION="tf32" if dtype == "bf16" else "ieee", BLOCK_N=64 if d <= 64 else 32)
        yield triton_hstu._hstu_fwd, dtype, dict(common, HAS_PREFIX=full)
        yield triton_hstu._hstu_bwd_kv, dtype, dict(common, POS_GRAD=full, TIME_GRAD=full,
                                                     GRAD_SLOTS=triton_hstu._GRAD_SLOTS)
        yield triton_hstu._hstu_bwd_q, dtype, common
    for dtype in ("bf16",) if quick else ("bf16", "fp32"):
        norm = dict(HAS_W=True, HAS_B=True, BLOCK_R=16, BLOCK_D=256)
        yield triton_norm._ln_mul_fwd, dtype, norm
        yield triton_norm._ln_mul_bwd, dtype, norm
        yield triton_embedding._gather_fwd, dtype, dict(BLOCK_T=16, BLOCK_D=64)
        yield triton_embedding._gather_bwd, dtype, dict(BLOCK_T=16, BLOCK_D=64)


def compile_all(arch: int = 90, quick: bool = False):
    """Yields one record per compiled kernel configuration; raises on the first compile error."""
    target = GPUTarget("cuda", arch, 32)
    for fn, dtype, constexprs in _configs(quick):
        consts = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        start = time.perf_counter()
        compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn, consts, dtype), constexprs=consts),
                                  target=target, options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        yield {
            "kernel": fn.fn.__name__, "dtype": dtype, "constexprs": {k: str(v) for k, v in consts.items()},
            "seconds": round(time.perf_counter() - start, 2), "shared_bytes": compiled.metadata.shared,
            "tensor_cores": "wgmma" in ptx or "mma.sync" in ptx,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--quick", action="store_true", help="one full-featured bf16 configuration per kernel")
    args = parser.parse_args(argv)
    if is_interpreted(triton_hstu._hstu_fwd):
        print("error: TRITON_INTERPRET is set; unset it to compile for a GPU", file=sys.stderr)
        return 2
    for record in compile_all(args.arch, args.quick):
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU compiler accepts every kernel: lower them to sm_90 PTX/cubin on this CPU-only machine.

The interpreter runs the kernels' semantics, not Triton's GPU pipeline (layouts, dot operand types,
shared-memory limits); this catches what only the real compiler rejects. Runs in a subprocess because this
test session imported the kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_kernels_compile_for_hopper():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-P", "-m", "grstack.kernels.triton_aot", "--arch", "90", "--quick"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    kernels = {r["kernel"] for r in records}
    assert {"_hstu_fwd", "_hstu_bwd_kv", "_hstu_bwd_q"} <= kernels
    assert all(r["tensor_cores"] for r in records if r["kernel"].startswith("_hstu") and r["dtype"] == "bf16")

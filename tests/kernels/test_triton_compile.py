"""The fused kernels compile for Hopper without register spills: `grstack bench kernels --compile-report`.

The interpreter runs the kernels' semantics, not Triton's GPU pipeline (layouts, dot operand types,
register allocation); this lowers them through Triton's real compiler and ptxas to sm_90 on this CPU-only
machine and reads ptxas' report. The quick report covers every tile configuration the tuner may pick at
head size 64 with every feature on (the full report, all head sizes with and without features, is the
command itself and takes minutes). Runs in a subprocess because this test session imported the kernels
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grstack.kernels import triton_tuning

pytestmark = pytest.mark.integration


def test_compile_report_has_no_spills():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-m", "grstack.runtime.cli", "bench", "kernels", "--compile-report",
                           "--quick", "--json", "--workers", "2"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    records = report["compile"]
    assert report["target"] == "sm_90"
    expected = (len(triton_tuning.candidates("fwd", 64)) + len(triton_tuning.candidates("bwd_q", 64))
                + len(triton_tuning.candidates("bwd_kv", 64, ("POS_GRAD", "TIME_GRAD"))))
    assert len(records) == expected
    assert {r["kernel"] for r in records} == {"_hstu_fwd", "_hstu_bwd_kv", "_hstu_bwd_q"}
    for r in records:
        assert {"kernel", "config", "target", "n_regs", "n_spills", "shared_bytes"} <= set(r)
        assert r["n_spills"] == 0 and r["spill_load_bytes"] == 0, r
        assert 0 < r["n_regs"] <= 255 and r["tensor_cores"], r
    assert report["spill_free"] is True

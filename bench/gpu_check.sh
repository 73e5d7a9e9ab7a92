#!/usr/bin/env bash
# One-shot GPU check of the jagged HSTU kernels (issue 3), for a lent NVIDIA machine (H200).
#
#   device tool:  run  command="bash bench/gpu_check.sh"  timeout_s=600
#
# Runs from the repository root with the machine's own python3 (torch + triton, CUDA), no installs: the
# repo's folders are mapped onto the grstack namespace through a symlink shim on PYTHONPATH. Writes to $OUT:
#   env.txt           GPU, driver, torch/triton versions
#   kernel_tests.txt  tests/kernels on CUDA with compiled kernels (no interpreter), bf16 on tensor cores
#   kernels.json      `grstack bench kernels --device cuda --json` (jagged Triton vs padded torch, TFLOP/s)
#   kernels.err       the benchmark's progress log
# Budget: tests ~2-3 min (mostly Triton compiles), benchmark ~3-4 min; each step has its own timeout so a
# hang in one still leaves the others' files.
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
SHIM=$(mktemp -d)
mkdir -p "$SHIM/grstack"
for d in kernels runtime operator; do ln -s "$PWD/$d" "$SHIM/grstack/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

GRSTACK_KERNEL_TEST_DEVICE=cuda timeout 270 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/kernels -k "not compile_for_hopper" > "$OUT/kernel_tests.txt" 2>&1
echo "pytest exit status: $?" >> "$OUT/kernel_tests.txt"
tail -n 3 "$OUT/kernel_tests.txt"

timeout 300 "$PY" -m grstack.runtime.cli bench kernels --device cuda --json > "$OUT/kernels.json" 2> "$OUT/kernels.err"
echo "bench exit status: $?" >> "$OUT/kernels.err"
tail -n 2 "$OUT/kernels.err"
"$PY" - "$OUT/kernels.json" <<'PY'
import json, sys
try:
    cases = json.load(open(sys.argv[1]))["cases"]
except Exception as exc:  # the bench failed: its log says why
    print("no benchmark JSON:", exc)
    sys.exit(0)
for c in cases:
    print(f"{c['name']:14s} jagged {c['jagged_ms']:9.2f} ms  padded {c['padded_ms']:9.2f} ms  "
          f"x{c['speedup']:6.2f}  {c.get('jagged_tflops', 0):7.1f} TFLOP/s ({100 * c.get('jagged_share_of_peak', 0):.1f}% of peak)  "
          f"mem x{c['memory_ratio']}")
PY

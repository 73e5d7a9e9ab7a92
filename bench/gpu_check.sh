#!/usr/bin/env bash
# One-shot accelerator check, for a lent NVIDIA machine (H200: torch 2.11, Triton 3.6, Python 3.12, no pydantic,
# nothing can be installed from the network). See docs/gpu-check.md.
#
#   here, once:   bash bench/gpu_wheels.sh          (the missing wheels, into the git-ignored .whl/)
#   device tool:  run  command="bash bench/gpu_check.sh"  carry=[".whl"]  timeout_s=540
#
# Runs from the repository root with the machine's python3; the repo's folders are mapped onto the grstack
# namespace by a symlink shim on PYTHONPATH and missing wheels are installed from .whl into a temporary folder.
# Python always runs with -P (the repo's operator/ would shadow the standard library). The whole check has a
# deadline (GPU_CHECK_BUDGET_S, default 480 s): each step gets min(its cap, the time left) and is skipped when
# less than its minimum is left, so a slow step cuts the later ones instead of overrunning. Writes to $OUT
# (at most 8 files come back):
#   summary.txt        GPU, driver, versions; each step's exit status and time
#   log.txt            every step's progress and errors
#   train_nccl.json    `grstack train --nproc 1` on CUDA: a process group of one over NCCL, 20 steps, DBP on
#                      (every collective with device tensors); its summary, host syncs per step included
#   mfu.json           `grstack bench mfu` on configs/kuairand-27k-hstu-large.yaml (bf16, ~0.2B parameters)
#   kernel_tests.txt   tests/kernels on CUDA with compiled kernels (no interpreter)
#   kernels.json       `grstack bench kernels --device cuda --json`
#   relay_engine.json  `grstack bench relay-engine --device cuda --json`: the serving engine on CUDA (fused Triton
#                      prefix attention; prefill, cached and full ranks at 1K/4K/8K tokens, KV arena on and off)
set -u
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-480}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PY:-python3}
WORK=$(mktemp -d)
mkdir -p "$WORK/shim/grstack" "$WORK/site"
for d in kernels runtime operator; do ln -s "$PWD/$d" "$WORK/shim/grstack/$d"; done
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
: > "$LOG"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -P -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$SUMMARY" 2>&1

if ! "$PY" -P -c "import pydantic" 2>/dev/null; then
  if [ -d .whl ]; then
    "$PY" -P -m pip install --quiet --no-index --find-links .whl --target "$WORK/site" pydantic >> "$LOG" 2>&1 \
      && echo "wheels: pydantic installed from .whl" >> "$SUMMARY" \
      || echo "wheels: installing pydantic from .whl failed (see log.txt)" >> "$SUMMARY"
  else
    echo "wheels: pydantic is missing and there is no .whl/ (run bench/gpu_wheels.sh here and carry .whl)" >> "$SUMMARY"
  fi
fi
export PYTHONPATH="$WORK/shim:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME CAP_S MIN_S STDOUT_FILE COMMAND...: stdout to STDOUT_FILE, stderr to log.txt
step() {
  local name=$1 cap=$2 min=$3 out=$4
  shift 4
  local l t s rc
  l=$(left)
  if [ "$l" -lt "$min" ]; then
    echo "$name: skipped, ${l} s of the budget left (needs ${min} s)" | tee -a "$SUMMARY"
    return
  fi
  t=$(( cap < l ? cap : l ))
  echo "=== $name (limit ${t} s)" >> "$LOG"
  s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$out" 2>> "$LOG"
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - s )) s (limit ${t} s)$([ $rc -eq 124 ] && echo ', timed out')" | tee -a "$SUMMARY"
}

# the kernels first (issue #11's targets): d=64, KuaiRand-like up to 2,048 and fixed 512..4,096, autotuned
step bench_kernels 200 60 "$OUT/kernels.json" \
  "$PY" -P -m grstack.runtime.cli bench kernels --device cuda --quick --head-dims 64 --json

# kernel tests with compiled kernels; the tuner's first candidate only (tuning every test shape would compile
# every candidate)
GRSTACK_KERNEL_TEST_DEVICE=cuda GRSTACK_TRITON_AUTOTUNE=0 step kernel_tests 120 60 "$OUT/kernel_tests.txt" \
  "$PY" -P -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" tests/kernels \
  -k "not compile_report"

step train_nccl 120 60 "$OUT/train_nccl.json" \
  "$PY" -P -m grstack.runtime.cli train --nproc 1 --config configs/synthetic-tiny-hstu.yaml --out "$WORK/run" \
  --set train.device=cuda --set pipeline.dbp=true --set train.max_steps=20 --no-progress --json

step mfu 150 90 "$OUT/mfu.json" \
  "$PY" -P -m grstack.runtime.cli bench mfu --config configs/kuairand-27k-hstu-large.yaml --device cuda \
  --steps 10 --warmup 3 --json


step relay_engine 90 30 "$OUT/relay_engine.json" \
  "$PY" -P -m grstack.runtime.cli bench relay-engine --device cuda --json


"$PY" -P - "$OUT" <<'PY' | tee -a "$SUMMARY"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:  # the step failed or was skipped: log.txt says why
        print(f"{name}: no JSON ({type(exc).__name__})")
        return None
t = load("train_nccl.json")
if t:
    d = t.get("distributed", {})
    print(f"train_nccl: backend {d.get('backend')}, {t.get('steps')} steps, {t.get('samples_per_second', 0):.0f} "
          f"samples/s, host syncs per step {t.get('host_syncs_per_step')}, test ndcg@10 "
          f"{t.get('metrics', {}).get('test', {}).get('ndcg@10')}")
m = load("mfu.json")
if m:
    print(f"mfu: {m.get('flops_per_step', 0) / 1e12:.2f} TFLOP/step, step {m.get('step_ms')} ms, "
          f"{m.get('achieved_tflops')} TFLOP/s of {m.get('peak_tflops')} peak: MFU {m.get('mfu')}")
r = load("relay_engine.json")
for c in (r or {}).get("cases", []):
    print(f"relay_engine L={c['length']:5d}: prefill {c['prefill_ms']:.2f} ms (arena {c['prefill_arena_ms']:.2f}), "
          f"{c['batch']} cached ranks {c['rank_cached_batch_ms']:.2f} ms (arena {c['rank_cached_batch_arena_ms']:.2f}), "
          f"full rank {c['rank_full_ms']:.2f} ms, max |diff| {c['max_abs_score_diff']}")
k = load("kernels.json")
for c in (k or {}).get("cases", []):
    print(f"kernels {c.get('name', '?'):14s} jagged {c.get('jagged_ms', 0):9.2f} ms  padded {c.get('padded_ms', 0):9.2f} ms  "
          f"x{c.get('speedup', 0):6.2f}  {c.get('jagged_share_of_peak', 0):.1%} of peak")
    for v in c.get("variants", []):
        print(f"  {v['variant']:30s} jagged {v['jagged_ms']:9.2f} ms  padded {v['padded_ms']:9.2f} ms  "
              f"x{v['speedup']:6.2f}  {v.get('jagged_share_of_peak', 0):.1%} of peak")
PY
echo "total: $(( $(date +%s) - START )) s of a ${BUDGET} s budget" | tee -a "$SUMMARY"

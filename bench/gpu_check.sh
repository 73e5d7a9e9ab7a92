#!/usr/bin/env bash
# One-shot accelerator check, for a lent NVIDIA machine (H200: torch 2.11, Triton 3.6, Python 3.12, no pydantic,
# nothing can be installed from the network). See docs/gpu-check.md.
#
#   here, once:   bash bench/gpu_wheels.sh          (the missing wheels, into the git-ignored .whl/)
#   here, always: bash bench/gpu_check.sh --dry-run (every step on CPU; exit 0 when every step passes)
#   device tool:  run  command="bash bench/gpu_check.sh"  carry=[".whl"]  timeout_s=540
#
# Options: --dry-run (every step on this machine's CPU: device cpu, TRITON_INTERPRET=1 for the kernel steps, the
# smallest sizes each command allows, a 240 s budget, PY defaulting to .venv/bin/python, OUT to a new temporary
# folder); --only STEP[,STEP...] (those steps only; the others are listed as not selected).
#
# Runs from the repository root with the machine's python3; the repo's folders are mapped onto the grstack
# namespace by a symlink shim on PYTHONPATH and missing wheels are installed from .whl (GPU_CHECK_WHEELS) into a
# temporary folder; a wheel that is missing with nothing to install it from stops the check at once (exit 2,
# one line). Python always runs with -P (the repo's operator/ would shadow the standard library). The whole
# check has a deadline (GPU_CHECK_BUDGET_S, default 480 s): each step gets min(its cap, the time left) and is
# skipped when less than its minimum is left, so a slow step cuts the later ones instead of overrunning; a step
# past its limit gets SIGINT first (pytest then still writes its summary and junit file), SIGKILL 15 s later.
# Exit status: 0 when every selected step exited 0, 1 otherwise. Writes to $OUT (at most 8 files come back):
#   summary.txt        GPU, driver, versions; each step's exit status and time; a digest of the results
#   log.txt            every step's progress and errors
#   train_nccl.json    `grstack train --nproc 1` on CUDA: a process group of one over NCCL, 20 steps, DBP on,
#                      strict placement (a tensor on the wrong device is refused); its summary, host syncs per
#                      step (CUDA's sync counter) included
#   kernels.json       `grstack bench kernels --device cuda --json`
#   kernel_tests.txt   tests/kernels on CUDA with compiled kernels (no interpreter), one line per test (-v -rfE)
#   kernel_tests.xml   the same tests' junit report
#   mfu.json           `grstack bench mfu` on configs/kuairand-27k-hstu-large.yaml (bf16, ~0.2B parameters)
#   relay_engine.json  `grstack bench relay-engine --device cuda --json`: the serving engine on CUDA (fused Triton
#                      prefix attention; prefill, cached and full ranks at 1K/4K/8K tokens, KV arena on and off)
set -u
STEPS="train_nccl bench_kernels kernel_tests mfu relay_engine"
DRY=0
ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --only) [ $# -ge 2 ] || { echo "error: --only needs STEP[,STEP...] (steps: $STEPS)" >&2; exit 2; }
            ONLY=$2; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed -e '/^set -u/d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument '$1' (expected --dry-run, --only STEP[,STEP...])" >&2; exit 2 ;;
  esac
  shift
done
SELECTED=$STEPS
if [ -n "$ONLY" ]; then
  SELECTED=""
  for s in ${ONLY//,/ }; do
    case " $STEPS " in
      *" $s "*) SELECTED="$SELECTED $s" ;;
      *) echo "error: unknown step '$s' (steps: $STEPS)" >&2; exit 2 ;;
    esac
  done
  [ -n "$SELECTED" ] || { echo "error: --only names no step (steps: $STEPS)" >&2; exit 2; }
fi

START=$(date +%s)
if [ "$DRY" = 1 ]; then
  BUDGET=${GPU_CHECK_BUDGET_S:-240}
  OUT=${OUT:-$(mktemp -d -t grstack-gpu-check-dry.XXXXXX)}
  if [ -z "${PY:-}" ]; then PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python; fi
  DEV=cpu
else
  BUDGET=${GPU_CHECK_BUDGET_S:-480}
  OUT=${OUT:-$PWD/gpu_out}
  PY=${PY:-python3}
  DEV=cuda
fi
WHEELS=${GPU_CHECK_WHEELS:-.whl}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/shim/grstack" "$WORK/site"
for d in kernels runtime operator; do ln -s "$PWD/$d" "$WORK/shim/grstack/$d"; done
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
: > "$LOG"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  if [ "$DRY" = 1 ]; then
    echo "dry run on CPU (TRITON_INTERPRET=1 for the kernel steps), budget ${BUDGET} s"
    "$PY" -P -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
  else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" -P -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  fi
} > "$SUMMARY" 2>&1

# the wheels the check needs: a missing one with nothing to install it from ends the check here
stop() { echo "error: $1" | tee -a "$SUMMARY" >&2; exit 2; }
if ! "$PY" -P -c "import pydantic" 2>/dev/null; then
  [ -d "$WHEELS" ] || stop "pydantic is missing and there is no $WHEELS/ (run bash bench/gpu_wheels.sh here and carry .whl)"
  "$PY" -P -m pip install --quiet --no-index --find-links "$WHEELS" --target "$WORK/site" pydantic >> "$LOG" 2>&1 \
    || stop "pydantic is missing and installing it from $WHEELS/ failed (see log.txt; rerun bash bench/gpu_wheels.sh)"
  echo "wheels: pydantic installed from $WHEELS" >> "$SUMMARY"
fi
export PYTHONPATH="$WORK/shim:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# a step's own SIGINT handler must run even where the caller started us with SIGINT ignored
DEFSIG=()
env --default-signal=INT true 2>/dev/null && DEFSIG=(env --default-signal=INT)
FAILED=0

# step NAME CAP_S MIN_S STDOUT_FILE COMMAND...: stdout to STDOUT_FILE, stderr to log.txt
step() {
  local name=$1 cap=$2 min=$3 out=$4
  shift 4
  local l t s rc
  case " $SELECTED " in *" $name "*) ;; *) echo "$name: not selected" >> "$SUMMARY"; return ;; esac
  [ "$DRY" = 1 ] && min=5
  l=$(left)
  if [ "$l" -lt "$min" ]; then
    echo "$name: skipped, ${l} s of the budget left (needs ${min} s)" | tee -a "$SUMMARY"
    FAILED=1
    return
  fi
  t=$(( cap < l ? cap : l ))
  echo "=== $name (limit ${t} s)" >> "$LOG"
  s=$(date +%s)
  timeout -s INT -k 15 "$t" "${DEFSIG[@]}" "$@" > "$out" 2>> "$LOG"
  rc=$?
  [ $rc -eq 0 ] || FAILED=1
  echo "$name: exit $rc in $(( $(date +%s) - s )) s (limit ${t} s)$([ $rc -eq 124 ] && echo ', timed out')" | tee -a "$SUMMARY"
}

CLI=("$PY" -P -m grstack.runtime.cli)
if [ "$DRY" = 1 ]; then
  TRAIN_SET=(--set train.device=cpu --set train.max_steps=3 --set eval.max_users=64)
  KERNELS_ARGS=(--device cpu --quick --head-dims 16 --reps 1)
  KERNEL_TESTS=(tests/kernels/test_triton_tiles.py -k "tile_shape or host_sync")
  MFU_ARGS=(--config configs/synthetic-tiny-hstu.yaml --device cpu --steps 1 --warmup 0)
  RELAY_ARGS=(--device cpu --quick --lengths 64 --batch 1 --candidates 4 --short 2 --repeats 1)
  KENV=(env TRITON_INTERPRET=1)
  TENV=(env TRITON_INTERPRET=1 GRSTACK_KERNEL_TEST_DEVICE=cpu)
else
  TRAIN_SET=(--set train.device=cuda --set train.max_steps=20)
  KERNELS_ARGS=(--device cuda --quick --head-dims 64)
  KERNEL_TESTS=(tests/kernels -k "not compile_report")
  MFU_ARGS=(--config configs/kuairand-27k-hstu-large.yaml --device cuda --steps 10 --warmup 3)
  RELAY_ARGS=(--device cuda)
  KENV=(env)
  # the tests: the tuner's first candidate only (tuning every test shape would compile every candidate)
  TENV=(env GRSTACK_KERNEL_TEST_DEVICE=cuda GRSTACK_TRITON_AUTOTUNE=0)
fi

# the NCCL training step first: every collective with device tensors, strict placement, the sync counter
step train_nccl 120 60 "$OUT/train_nccl.json" \
  "${CLI[@]}" train --nproc 1 --config configs/synthetic-tiny-hstu.yaml --out "$WORK/run" \
  --set pipeline.dbp=true "${TRAIN_SET[@]}" --no-progress --json

# the kernels (issue #11's targets): d=64, KuaiRand-like up to 2,048 and fixed 512..4,096, autotuned
step bench_kernels 200 60 "$OUT/kernels.json" "${KENV[@]}" "${CLI[@]}" bench kernels "${KERNELS_ARGS[@]}" --json

# kernel tests with compiled kernels: a line per test as it runs, so a step cut by its limit still names them
step kernel_tests 120 60 "$OUT/kernel_tests.txt" "${TENV[@]}" \
  "$PY" -P -m pytest -v -rfE -p no:cacheprovider -o addopts="--import-mode=importlib" \
  --junitxml "$OUT/kernel_tests.xml" "${KERNEL_TESTS[@]}"

step mfu 150 90 "$OUT/mfu.json" "${CLI[@]}" bench mfu "${MFU_ARGS[@]}" --json

step relay_engine 90 30 "$OUT/relay_engine.json" "${CLI[@]}" bench relay-engine "${RELAY_ARGS[@]}" --json


"$PY" -P - "$OUT" $SELECTED <<'PY' | tee -a "$SUMMARY"
import json, pathlib, sys
import xml.etree.ElementTree as ET
out, selected = pathlib.Path(sys.argv[1]), set(sys.argv[2:])
def load(name, step):
    if step not in selected:
        return None
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:  # the step failed or was skipped: log.txt says why
        print(f"{name}: no JSON ({type(exc).__name__})")
        return None
t = load("train_nccl.json", "train_nccl")
if t:
    d = t.get("distributed", {})
    print(f"train_nccl: backend {d.get('backend')}, {t.get('steps')} steps, {t.get('samples_per_second', 0):.0f} "
          f"samples/s, host syncs per step {t.get('host_syncs_per_step')} "
          f"({t.get('host_syncs_counter')}), test ndcg@10 "
          f"{t.get('metrics', {}).get('test', {}).get('ndcg@10')}")
if "kernel_tests" in selected:
    try:
        suites = ET.parse(out / "kernel_tests.xml").getroot()
        cases = list(suites.iter("testcase"))
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in cases
               if c.find("failure") is not None or c.find("error") is not None]
        skipped = sum(c.find("skipped") is not None for c in cases)
        print(f"kernel_tests: {len(cases)} tests, {len(bad)} failed, {skipped} skipped"
              + "".join(f"\n  failed: {b}" for b in bad))
    except Exception as exc:  # killed before pytest wrote it: kernel_tests.txt names the tests that ran
        print(f"kernel_tests.xml: not readable ({type(exc).__name__}); see kernel_tests.txt")
m = load("mfu.json", "mfu")
if m:
    print(f"mfu: {m.get('flops_per_step', 0) / 1e12:.2f} TFLOP/step, step {m.get('step_ms')} ms, "
          f"{m.get('achieved_tflops')} TFLOP/s of {m.get('peak_tflops')} peak: MFU {m.get('mfu')}")
r = load("relay_engine.json", "relay_engine")
for c in (r or {}).get("cases", []):
    print(f"relay_engine L={c['length']:5d}: prefill {c['prefill_ms']:.2f} ms (arena {c['prefill_arena_ms']:.2f}), "
          f"{c['batch']} cached ranks {c['rank_cached_batch_ms']:.2f} ms (arena {c['rank_cached_batch_arena_ms']:.2f}), "
          f"full rank {c['rank_full_ms']:.2f} ms, max |diff| {c['max_abs_score_diff']}")
k = load("kernels.json", "bench_kernels")
for c in (k or {}).get("cases", []):
    print(f"kernels {c.get('name', '?'):14s} jagged {c.get('jagged_ms', 0):9.2f} ms  padded {c.get('padded_ms', 0):9.2f} ms  "
          f"x{c.get('speedup', 0):6.2f}  {c.get('jagged_share_of_peak', 0):.1%} of peak")
    for v in c.get("variants", []):
        print(f"  {v['variant']:30s} jagged {v['jagged_ms']:9.2f} ms  padded {v['padded_ms']:9.2f} ms  "
              f"x{v['speedup']:6.2f}  {v.get('jagged_share_of_peak', 0):.1%} of peak")
PY
echo "total: $(( $(date +%s) - START )) s of a ${BUDGET} s budget" | tee -a "$SUMMARY"
[ "$DRY" = 1 ] && echo "dry run: the files are in $OUT" >&2
exit $FAILED

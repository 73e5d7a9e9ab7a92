"""Stands in for ``grstack train`` in fast operator tests: same arguments, checkpoints, resume and progress
reports (through the real ``report_progress``), with failures on demand from environment variables:

FAKE_STEPS (total steps, default 6), FAKE_STEP_SECONDS (default 0.05), FAKE_EXIT (exit with this status at
start), FAKE_CRASH_AT (exit 1 when reaching this step, FAKE_CRASHES times in total; default once),
FAKE_HANG_AT (stop making progress at this step and wait to be killed). Rank 0 (``RANK``) writes the
checkpoints and reports; the other ranks step along. Files are replaced atomically, as the real trainer's
checkpoints are: a rank starting while rank 0 checkpoints reads the previous checkpoint or the next, whole.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from grstack.runtime.train.progress import report_progress


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def read_step(ckpt: Path) -> int:
    return json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--nproc", type=int, default=1)  # local ranks: one process stands in for all
    args = parser.parse_args()
    Path(args.config).read_text()
    if os.environ.get("FAKE_EXIT"):
        print("error: config: invalid on purpose", file=sys.stderr)
        return int(os.environ["FAKE_EXIT"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / "checkpoint.json"
    crashes = out / "crashes"
    step = read_step(ckpt)
    total = int(os.environ.get("FAKE_STEPS", "6"))
    rank0 = os.environ.get("RANK", "0") == "0"
    with (out / "starts").open("a") as f:
        f.write(f"{os.environ['GRSTACK_POD_NAME']} {step}\n")
    while step < total:
        time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0.05")))
        step += 1
        report_progress({"step": step, "epoch": 0, "total_steps": total, "loss": 1.0 / step,
                         "samples_per_second": 100.0, "tokens_per_second": 1000.0})
        if step % 2 == 0 and rank0:
            write_atomically(ckpt, json.dumps({"step": step}))
            report_progress({"step": step, "last_checkpoint": str(ckpt)})
        crashed = int(crashes.read_text()) if crashes.exists() else 0
        if rank0 and str(step) == os.environ.get("FAKE_CRASH_AT") and crashed < int(os.environ.get("FAKE_CRASHES", "1")):
            write_atomically(crashes, str(crashed + 1))
            print(f"crash at step {step}", file=sys.stderr)
            return 1
        if str(step) == os.environ.get("FAKE_HANG_AT"):
            time.sleep(3600)
    report_progress({"finished": True, "metrics": {"ndcg@10": 0.5}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

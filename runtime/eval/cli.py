"""``grstack eval``: leave-one-out full-ranking evaluation of a finished (or running) run."""

from __future__ import annotations

import argparse
import json


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="run directory written by grstack train")
    parser.add_argument("--split", choices=("valid", "test", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grstack.runtime.data import LeaveOneOut, read_dataset
    from grstack.runtime.errors import UserError
    from grstack.runtime.eval.evaluate import evaluate
    from grstack.runtime.model import BEST_MODEL, DATASET_DIR, load_exported

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    model_path = run_dir / BEST_MODEL
    if not model_path.is_file():
        raise UserError(f"{run_dir} has no {BEST_MODEL} yet (it is written after the first validation)")
    model, cfg, _ = load_exported(model_path)
    split = LeaveOneOut(read_dataset(run_dir / DATASET_DIR), min_len=cfg.data.min_len)
    which = ("valid", "test") if args.split == "both" else (args.split,)
    results = {w: evaluate(model, split, w, max_len=cfg.data.max_len, ks=cfg.eval.ks,
                           batch_size=cfg.eval.batch_size) for w in which}
    if args.json:
        print(json.dumps({"run": str(run_dir), "model": cfg.model.type, "metrics": results}, indent=2))
    else:
        for w, m in results.items():
            print(f"{w:5s} " + " ".join(f"{k}={v:.4f}" for k, v in m.items()))
    return 0

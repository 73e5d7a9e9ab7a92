"""``grstack bench quality``: train and evaluate one or more configs in one run and print their numbers.

Side by side in one process on one machine, so ratios between configs (e.g. HSTU vs SASRec) are fair even
on a shared, noisy machine. Every table in the README comes from this command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def register(parser: argparse.ArgumentParser) -> None:
    from grstack.runtime import cli_args as ca

    parser.add_argument("configs", nargs="+", type=ca.config_file, help="config names in configs/ or paths")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        type=ca.override, help="override applied to every config (repeatable)")
    parser.add_argument("--out", default=None, type=ca.output_dir,
                        help="keep run directories under this folder (default: a new temporary folder)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (default)")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.config_files import config_path
    from grstack.runtime.train import train
    from grstack.runtime.training_config import load_config

    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="grstack-quality-"))
    results = []
    for name in args.configs:
        cfg = load_config(config_path(name), args.overrides)
        run_dir = base / cfg.name
        print(f"[bench quality] {cfg.name} -> {run_dir}", file=sys.stderr)
        summary = train(cfg, run_dir, progress=args.progress)
        results.append({"config": cfg.name, "run_dir": str(run_dir), **{k: summary[k] for k in (
            "model", "dataset", "steps", "epochs", "best_epoch", "train_seconds", "samples_per_second",
            "tokens_per_second", "threads", "metrics")}})
    out: dict = {"runs": results}
    if len(results) >= 2:
        a, b = results[0], results[1]
        out["ratios"] = {
            "test_ndcg@10": a["metrics"]["test"]["ndcg@10"] / max(b["metrics"]["test"]["ndcg@10"], 1e-12),
            "test_hr@10": a["metrics"]["test"]["hr@10"] / max(b["metrics"]["test"]["hr@10"], 1e-12),
            "samples_per_second": a["samples_per_second"] / max(b["samples_per_second"], 1e-12),
            "of": f"{a['config']} / {b['config']}",
        }
        ranked = [r["metrics"]["test"].get("ranking") or {} for r in (a, b)]
        gaps = {task: ranked[0][task]["gauc"] - ranked[1][task]["gauc"] for task in ranked[0]
                if isinstance(ranked[0][task], dict) and isinstance(ranked[1].get(task), dict)
                and ranked[0][task].get("gauc") is not None and ranked[1][task].get("gauc") is not None}
        if gaps:  # the ranking heads' per-user AUC, first config minus second, per task
            out["differences"] = {"test_ranking_gauc": gaps, "of": f"{a['config']} - {b['config']}"}
    print(json.dumps(out, indent=2))
    return 0

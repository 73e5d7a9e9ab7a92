"""``grstack train``: train a model from a config on this machine."""

from __future__ import annotations

import argparse
import json
import sys


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.epochs=3 (repeatable)")
    parser.add_argument("--out", required=True, help="run directory; an existing checkpoint there is resumed")
    parser.add_argument("--stop-after-step", type=int, default=None, metavar="N",
                        help="checkpoint and exit after global step N (resume later with the same command)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.config import load_config
    from grstack.runtime.train.loop import train

    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, args.out, progress=not args.no_progress, stop_after=args.stop_after_step)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif "stopped_at_step" in summary:
        print(f"stopped at step {summary['stopped_at_step']}; checkpoint in {args.out}/checkpoints")
    else:
        print(format_summary(summary, args.out))
    sys.stdout.flush()
    return 0


def format_summary(summary: dict, run_dir: str) -> str:
    test = summary["metrics"]["test"]
    valid = summary["metrics"]["valid"]
    lines = [
        f"{summary['model']} on {summary['dataset']}: {summary['steps']} steps, {summary['epochs']} epochs "
        f"(best epoch {summary['best_epoch']}), {summary['train_seconds']:.1f} s training, "
        f"{summary['samples_per_second']:.0f} samples/s, {summary['tokens_per_second']:.0f} tokens/s",
        "          " + " ".join(f"{k:>9}" for k in test),
        "  valid   " + " ".join(f"{v:9.4f}" for v in valid.values()),
        "  test    " + " ".join(f"{v:9.4f}" for v in test.values()),
        f"run directory: {run_dir} (summary.json, metrics.jsonl, training_curve.png, model.pt)",
    ]
    return "\n".join(lines)

"""``grstack train``: train a model from a config on this machine."""

from __future__ import annotations

import argparse
import json
import sys

from grstack.runtime import cli_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=cli_args.config_file,
                        help="YAML config: a path, or a name in configs/ (e.g. synthetic-tiny-hstu)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        type=cli_args.override,
                        help="override a config field, e.g. --set train.epochs=3 (repeatable)")
    parser.add_argument("--out", required=True, type=cli_args.output_dir,
                        help="run directory; an existing checkpoint there is resumed")
    parser.add_argument("--stop-after-step", type=cli_args.positive_int, default=None, metavar="N",
                        help="checkpoint and exit after global step N (resume later with the same command)")
    parser.add_argument("--nproc", type=cli_args.positive_int, default=None, metavar="N",
                        help="train on N local ranks (sharded embeddings; gloo on CPU, NCCL/HCCL on "
                             "accelerators, one per rank), --nproc 1 included (a process group of one: every "
                             "collective runs); without it, one process and no process group. Inside a pod "
                             "the torchrun environment (WORLD_SIZE, RANK, MASTER_ADDR, ...) makes this one rank; "
                             "with --nproc N there, N ranks: RANK = NODE_RANK * N + LOCAL_RANK, "
                             "LOCAL_WORLD_SIZE must be N")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.training_config import load_config

    cfg = load_config(args.config, args.overrides)
    summary = _train(cfg, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif "stopped_at_step" in summary:
        print(f"stopped at step {summary['stopped_at_step']}; checkpoint in {args.out}/checkpoints")
    else:
        print(format_summary(summary, args.out))
    sys.stdout.flush()
    return 0


def _train(cfg, args: argparse.Namespace) -> dict:
    """Single process, N local ranks (--nproc), or one rank of a torchrun-style job (WORLD_SIZE set)."""
    from grstack.runtime.train.context import DistEnv

    progress, stop = not args.no_progress, args.stop_after_step
    env = DistEnv.from_env()
    if env is not None and env.world_size > 1:
        if args.nproc is not None:  # this pod's share of the job: --nproc local ranks from RANK = NODE_RANK * N
            from grstack.runtime.train.launch import node_from_env, train_distributed

            return train_distributed(cfg, args.out, nproc=args.nproc, progress=progress, stop_after=stop,
                                     node=node_from_env(args.nproc))
        from grstack.runtime.train.launch import run_rank

        return run_rank(cfg, args.out, env, progress=progress, stop_after=stop)
    if args.nproc is not None:
        from grstack.runtime.train.launch import train_distributed

        return train_distributed(cfg, args.out, nproc=args.nproc, progress=progress, stop_after=stop)
    from grstack.runtime.train.trainer import train

    return train(cfg, args.out, progress=progress, stop_after=stop)


def format_summary(summary: dict, run_dir: str) -> str:
    from grstack.runtime.eval import format_ranking

    test = {k: v for k, v in summary["metrics"]["test"].items() if k != "ranking"}
    valid = {k: v for k, v in summary["metrics"]["valid"].items() if k != "ranking"}
    lines = [
        f"{summary['model']} on {summary['dataset']}: {summary['steps']} steps, {summary['epochs']} epochs "
        f"(best epoch {summary['best_epoch']}), {summary['train_seconds']:.1f} s training, "
        f"{summary['samples_per_second']:.0f} samples/s, {summary['tokens_per_second']:.0f} tokens/s",
        "          " + " ".join(f"{k:>9}" for k in test),
        "  valid   " + " ".join(f"{v:9.4f}" for v in valid.values()),
        "  test    " + " ".join(f"{v:9.4f}" for v in test.values()),
        *(line for w in ("valid", "test") for line in format_ranking(w, summary["metrics"][w].get("ranking", {}))),
        f"run directory: {run_dir} (summary.json, metrics.jsonl, training_curve.png, model.pt)",
    ]
    return "\n".join(lines)

"""``grstack demo``: the main job on one machine with no data and no services.

Generates KuaiRand-like synthetic data, trains a small HSTU (retrieval + ranking heads) on two local ranks
(row-sharded item embeddings over gloo, dual-buffer pipelining), evaluates it with leave-one-out full ranking
next to a popularity baseline, then serves the trained model with the relay-race ranking service (a router
and two rankers on loopback) under a short load, and prints a report that gives each figure with what it
means and what chance would score (``demo_report``). Each phase says on stderr when it starts and ends.
``--quick`` runs the tiny preset in a run directory of its own, so it never collides with the full demo's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grstack.runtime import cli_args

if TYPE_CHECKING:
    from grstack.runtime.training_config import Config

DEMO_CONFIG = "synthetic-tiny-hstu"
DEMO_OVERRIDES = [
    "name=demo",
    "data.source=small",
    "data.max_len=128",
    "model.d_model=48",
    "model.num_blocks=2",
    "model.dropout=0.2",
    "model.input_dropout=0.2",
    "loss.negatives=128",
    # the ranking head's loss weighs as much as retrieval's: at the config's 0.1 the small head does not
    # learn to tell the next item from random ones within the demo's few epochs (test AUC near or below 0.5)
    "loss.ranking_weight=1",
    "optim.lr=0.002",
    "train.batch_size=64",
    "train.epochs=3",
    "train.log_every=3",
]
# The tiny preset has 7 batches an epoch: 16 epochs train the ranking head past chance in seconds.
QUICK_OVERRIDES = ["data.source=tiny", "train.epochs=16", "train.eval_every_epochs=4", "train.log_every=2"]
DEFAULT_OUT = {False: "runs/demo", True: "runs/demo-quick"}


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, type=cli_args.output_dir,
                        help=f"run directory (default: {DEFAULT_OUT[False]}; with --quick {DEFAULT_OUT[True]})")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny preset, 16 short epochs (well under a minute on 2 cores)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        type=cli_args.override, help="extra config overrides, after the demo's own (repeatable)")
    parser.add_argument("--nproc", type=cli_args.positive_int, default=2, metavar="N",
                        help="local training ranks (default 2: sharded embeddings over gloo; 1 = one process)")
    parser.add_argument("--no-serve", action="store_true", help="skip the serving leg")
    parser.add_argument("--requests", type=cli_args.positive_int, default=200,
                        help="rank requests the serving leg sends")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or phase lines on stderr")
    parser.set_defaults(func=run)


def popularity_baseline(run_dir: Path, ks: list[int], max_len: int) -> dict[str, float]:
    """Most-popular-items ranking under the same protocol: what a model must beat to have learned anything."""
    import numpy as np
    import torch

    from grstack.runtime.data import LeaveOneOut, read_dataset
    from grstack.runtime.eval import exclude_history, metrics_from_ranks, target_ranks

    split = LeaveOneOut(read_dataset(run_dir / "dataset"))
    counts = np.bincount(split.ds.item_ids, minlength=split.ds.num_items + 1).astype(np.float64)
    rows = np.arange(split.num_users)
    _, targets = split.eval_batch("test", rows, max_len)
    scores = torch.from_numpy(counts)[None, :].repeat(len(rows), 1)
    exclude_history(scores, targets, *split.full_history("test", rows))
    return metrics_from_ranks(target_ranks(scores, targets).numpy(), ks)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.config_files import config_path
    from grstack.runtime.training_config import load_config

    out = Path(args.out if args.out is not None else DEFAULT_OUT[args.quick])
    overrides = list(DEMO_OVERRIDES)
    if args.quick:
        overrides += QUICK_OVERRIDES
    if args.nproc > 1:
        overrides.append("pipeline.dbp=true")
    cfg = load_config(config_path(DEMO_CONFIG), overrides + args.overrides)
    check_run_dir(out, cfg)
    say = _stderr_lines(not args.no_progress)
    ranks = f"{args.nproc} ranks" if args.nproc > 1 else "1 process"
    print(f"grstack demo: synthetic KuaiRand-like data ({cfg.data.source} preset) -> HSTU on {ranks} -> "
          f"leave-one-out evaluation{'' if args.no_serve else ' -> relay-race serving'}; run directory {out}")
    t0 = time.perf_counter()
    describe_data(cfg, say)
    how = f"on {args.nproc} ranks (item embeddings sharded over gloo)" if args.nproc > 1 else "in this process"
    say(f"training: {cfg.model.type.upper()} ({cfg.model.num_blocks} blocks, d={cfg.model.d_model}) {how}, "
        f"{cfg.train.epochs} epochs, batch {cfg.train.batch_size}, validation every "
        f"{_every(cfg.train.eval_every_epochs)}")
    if args.nproc > 1:
        from grstack.runtime.train import train_distributed

        summary = train_distributed(cfg, out, nproc=args.nproc, progress=not args.no_progress)
    else:
        from grstack.runtime.train import train

        summary = train(cfg, out, progress=not args.no_progress)
    if "stopped_at_step" in summary:
        return 0
    say("evaluation: the most-popular-items baseline on the same test users")
    pop = popularity_baseline(out, cfg.eval.ks, cfg.data.max_len)
    (out / "baseline_popularity.json").write_text(json.dumps(pop, indent=2) + "\n")
    print(report(summary, pop, str(out), cfg.loss.ranking_candidates))
    if not args.no_serve:
        from grstack.runtime.serve import serve_demo

        serving = serve_demo(out, replicas=2, requests=args.requests, say=say)
        (out / "serve_report.json").write_text(json.dumps(serving, indent=2, default=str) + "\n")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s; the training curve is {out / 'training_curve.png'}")
    return 0


def report(summary: dict[str, Any], popularity: dict[str, float], run_dir: str, candidates: int) -> str:
    """The trainer's summary table, then every figure with its meaning and chance's."""
    from grstack.runtime import demo_report
    from grstack.runtime.train import format_summary

    plain = {**summary, "metrics": {w: {k: v for k, v in m.items() if k != "ranking"}
                                    for w, m in summary["metrics"].items()}}
    return "\n".join([format_summary(plain, run_dir),
                      *demo_report.retrieval_lines(summary, popularity),
                      *demo_report.ranking_lines(summary["metrics"]["test"].get("ranking"), candidates)])


def check_run_dir(out: Path, cfg: Config) -> None:
    """``out`` must be new, empty, or an unfinished run of this demo's data and model (the trainer checks the
    rest): else one error line before any rank starts (e.g. ``--out`` of a ``--quick`` run without ``--quick``)."""
    import yaml

    from grstack.runtime.errors import UserError

    if not out.exists() or not any(out.iterdir()):
        return
    if (out / "summary.json").is_file():
        raise UserError(f"{out} holds a finished demo run (its summary.json and training_curve.png); remove it to "
                        "run the demo again, or choose another --out")
    saved_file = out / "config.yaml"
    if not (out / "checkpoints").is_dir() or not saved_file.is_file():
        raise UserError(f"{out} exists and is not empty; choose another --out or remove it")
    saved = yaml.safe_load(saved_file.read_text()) or {}
    mine = cfg.model_dump(mode="json")
    differ = [f"{section}.{key}" for section in ("data", "model") for key in sorted(mine[section])
              if not isinstance(saved.get(section), dict) or saved[section].get(key) != mine[section][key]]
    if differ:
        raise UserError(f"{out} holds a run of another demo configuration ({', '.join(differ)} differ: "
                        f"{DEFAULT_OUT[False]} is the demo's, {DEFAULT_OUT[True]} the quick one's); choose another "
                        "--out or remove it")


def describe_data(cfg: Config, say: Callable[[str], None]) -> None:
    """The data phase: what the ranks will train on (generated or read here too, to say so before they start)."""
    from grstack.runtime.data import load_source

    data = cfg.data
    what = f"generating the {data.source} synthetic preset (seed {data.seed})" if data.format == "synth" else \
        f"reading {data.source}"
    say(f"data: {what}")
    t0 = time.perf_counter()
    ds = load_source(data)
    labels = f"; labels {', '.join(ds.action_names)}" if ds.action_names else ""
    say(f"data: {ds.num_users:,} users, {ds.num_items:,} items, {ds.num_events:,} events{labels} "
        f"({time.perf_counter() - t0:.1f} s)")


def _every(epochs: int) -> str:
    return "epoch" if epochs == 1 else f"{epochs} epochs"


def _stderr_lines(enabled: bool) -> Callable[[str], None]:
    def say(line: str) -> None:
        if enabled:
            print(f"demo: {line}", file=sys.stderr, flush=True)

    return say

"""``grstack demo``: the main job on one machine with no data and no services.

Generates KuaiRand-like synthetic data, trains a small HSTU (retrieval + ranking heads) on two local ranks
(row-sharded item embeddings over gloo, dual-buffer pipelining), evaluates it with leave-one-out full ranking
next to a popularity baseline, then serves the trained model with the relay-race ranking service (a router
and two rankers on loopback) under a short load, and prints a short report.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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
    "optim.lr=0.002",
    "train.batch_size=64",
    "train.epochs=3",
    "train.log_every=10",
]


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    parser.add_argument("--quick", action="store_true", help="the tiny preset and one epoch (seconds)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config overrides")
    parser.add_argument("--nproc", type=int, default=2, metavar="N",
                        help="local training ranks (default 2: sharded embeddings over gloo; 1 = one process)")
    parser.add_argument("--no-serve", action="store_true", help="skip the serving leg")
    parser.add_argument("--requests", type=int, default=200, help="rank requests the serving leg sends")
    parser.add_argument("--no-progress", action="store_true")
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
    from grstack.runtime.errors import UserError
    from grstack.runtime.train import format_summary
    from grstack.runtime.training_config import load_config

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "checkpoints").is_dir():
        raise UserError(f"{out} exists and is not empty; choose another --out or remove it")
    overrides = list(DEMO_OVERRIDES)
    if args.quick:
        overrides += ["data.source=tiny", "train.epochs=1"]
    if args.nproc > 1:
        overrides.append("pipeline.dbp=true")
    cfg = load_config(config_path(DEMO_CONFIG), overrides + args.overrides)
    ranks = f"{args.nproc} ranks" if args.nproc > 1 else "1 process"
    print(f"grstack demo: synthetic KuaiRand-like data ({cfg.data.source} preset) -> HSTU on {ranks} -> "
          f"leave-one-out evaluation{'' if args.no_serve else ' -> relay-race serving'}; run directory {out}")
    t0 = time.perf_counter()
    if args.nproc > 1:
        from grstack.runtime.train import train_distributed

        summary = train_distributed(cfg, out, nproc=args.nproc, progress=not args.no_progress)
    else:
        from grstack.runtime.train import train

        summary = train(cfg, out, progress=not args.no_progress)
    if "stopped_at_step" in summary:
        return 0
    pop = popularity_baseline(out, cfg.eval.ks, cfg.data.max_len)
    (out / "baseline_popularity.json").write_text(json.dumps(pop, indent=2) + "\n")
    print(format_summary(summary, str(out)))
    ratio = summary["metrics"]["test"]["ndcg@10"] / max(pop["ndcg@10"], 1e-9)
    print(f"  popularity baseline test ndcg@10={pop['ndcg@10']:.4f} hr@10={pop['hr@10']:.4f} "
          f"-> HSTU is {ratio:.1f}x on ndcg@10")
    if not args.no_serve:
        from grstack.runtime.serve import serve_demo

        report = serve_demo(out, replicas=2, requests=args.requests)
        (out / "serve_report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0

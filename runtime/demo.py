"""``grstack demo``: the main job on one machine with no data and no services.

Generates KuaiRand-like synthetic data, trains a small HSTU (retrieval + ranking heads), evaluates it with
leave-one-out full ranking next to a popularity baseline, and prints a short report. Later stages (multi-rank
training, serving) extend it when those components are present.
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
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def popularity_baseline(run_dir: Path, ks: list[int], max_len: int) -> dict[str, float]:
    """Most-popular-items ranking under the same protocol: what a model must beat to have learned anything."""
    import numpy as np
    import torch

    from grstack.runtime.data.dataset import read_dataset
    from grstack.runtime.data.splits import LeaveOneOut
    from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks

    split = LeaveOneOut(read_dataset(run_dir / "dataset"))
    counts = np.bincount(split.ds.item_ids, minlength=split.ds.num_items + 1).astype(np.float64)
    rows = np.arange(split.num_users)
    _, targets = split.eval_batch("test", rows, max_len)
    scores = torch.from_numpy(counts)[None, :].repeat(len(rows), 1)
    scores[:, 0] = -torch.inf
    hist, hoff = split.full_history("test", rows)
    keep = scores.gather(1, targets[:, None]).clone()
    scores[torch.from_numpy(np.repeat(rows, np.diff(hoff))), torch.from_numpy(hist)] = -torch.inf
    scores.scatter_(1, targets[:, None], keep)
    return metrics_from_ranks(target_ranks(scores, targets).numpy(), ks)


def run(args: argparse.Namespace) -> int:
    from grstack.runtime.config import load_config
    from grstack.runtime.configs import config_path
    from grstack.runtime.errors import UserError
    from grstack.runtime.train.cli import format_summary
    from grstack.runtime.train.loop import train

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "checkpoints").is_dir():
        raise UserError(f"{out} exists and is not empty; choose another --out or remove it")
    overrides = list(DEMO_OVERRIDES)
    if args.quick:
        overrides += ["data.source=tiny", "train.epochs=1"]
    cfg = load_config(config_path(DEMO_CONFIG), overrides + args.overrides)
    print(f"grstack demo: synthetic KuaiRand-like data ({cfg.data.source} preset) -> HSTU -> leave-one-out "
          f"evaluation; run directory {out}")
    t0 = time.perf_counter()
    summary = train(cfg, out, progress=not args.no_progress)
    if "stopped_at_step" in summary:
        return 0
    pop = popularity_baseline(out, cfg.eval.ks, cfg.data.max_len)
    (out / "baseline_popularity.json").write_text(json.dumps(pop, indent=2) + "\n")
    print(format_summary(summary, str(out)))
    ratio = summary["metrics"]["test"]["ndcg@10"] / max(pop["ndcg@10"], 1e-9)
    print(f"  popularity baseline test ndcg@10={pop['ndcg@10']:.4f} hr@10={pop['hr@10']:.4f} "
          f"-> HSTU is {ratio:.1f}x on ndcg@10")
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return 0

"""``grstack eval``: leave-one-out full-ranking evaluation of a finished (or running) run, and of its ranking
head (AUC, GAUC, NE per task) when the model has a trained one."""

from __future__ import annotations

import argparse
import json

from grstack.runtime import cli_args


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, type=cli_args.input_dir, help="run directory written by grstack train")
    parser.add_argument("--split", choices=("valid", "test", "both"), default="both",
                        help="which held-out events to rank: each user's second-to-last, last, or both")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--all-users", action="store_true",
                        help="rank every user (default: the run's eval.max_users sample, the users its summary.json "
                             "was measured on)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from grstack.runtime.data import LeaveOneOut, read_dataset, select_features
    from grstack.runtime.errors import UserError
    from grstack.runtime.eval.evaluate import evaluate
    from grstack.runtime.eval.rank_head import evaluate_ranking, has_trained_rank_head
    from grstack.runtime.eval.ranking import format_ranking
    from grstack.runtime.model import BEST_MODEL, DATASET_DIR, load_exported

    run_dir = Path(args.run)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    model_path = run_dir / BEST_MODEL
    if not model_path.is_file():
        raise UserError(f"{run_dir} has no {BEST_MODEL} yet (it is written after the first validation)")
    model, cfg, tasks = load_exported(model_path)
    # the fields the model was trained on, in its order (the run's copy holds those; select_features checks)
    split = LeaveOneOut(select_features(read_dataset(run_dir / DATASET_DIR), cfg.data), min_len=cfg.data.min_len,
                        block=cfg.ranking_block())
    which = ("valid", "test") if args.split == "both" else (args.split,)
    max_users = None if args.all_users else cfg.eval.max_users
    results: dict[str, dict] = {w: dict(evaluate(model, split, w, max_len=cfg.data.max_len, ks=cfg.eval.ks,
                                                 batch_size=cfg.eval.batch_size, max_users=max_users))
                                for w in which}
    if getattr(model, "rank_head", None) is not None:  # the trainer's summary has the same block
        why = has_trained_rank_head(model, cfg.loss.ranking_weight)
        for w in which:
            results[w]["ranking"] = {"skipped": why} if why is not None else evaluate_ranking(
                model, split, w, tasks, max_len=cfg.data.max_len, num_candidates=cfg.loss.ranking_candidates,
                seed=cfg.train.seed, batch_size=cfg.eval.batch_size, max_users=max_users,
                ranking_on=cfg.loss.ranking_on)
    if args.json:
        print(json.dumps({"run": str(run_dir), "model": cfg.model.type, "metrics": results}, indent=2))
    else:
        for w, m in results.items():
            print(f"{w:5s} " + " ".join(f"{k}={v:.4f}" for k, v in m.items() if k != "ranking"))
            if "ranking" in m:
                print("\n".join(format_ranking(w, m["ranking"])))
    return 0

"""The trainer: one training run on one rank of a world of any size (a plain ``grstack train`` is a world
of one), on top of the sharded engine: run directory, metrics, exact resume, evaluation, summary.

There is one trainer and one batch builder, so every config section means the same thing at every world
size; a single-process run is the engine with one shard holding the whole item table, and its
collectives short-circuit (no process group). Every rank reads the dataset and computes the same schedule;
rank 0 alone writes the run directory's shared files (config, dataset, metrics, best model, summary) and
every rank writes its checkpoint part. Decisions that depend on the file system are made on rank 0 and
broadcast, so all ranks fail with the same message (or proceed) together, and a user error is raised
before anything is written. See docs/training.md.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn

from grstack.runtime.data import (
    LeaveOneOut,
    RankShare,
    SequenceDataset,
    deal,
    fingerprint,
    list_pieces,
    load_source,
    metadata_only,
    read_dataset,
    read_meta,
    select_features,
    write_dataset,
)
from grstack.runtime.device import configure_precision
from grstack.runtime.embedding import ShardedEmbedding, ShardingPlan, make_sparse_optimizer
from grstack.runtime.errors import UserError
from grstack.runtime.eval import has_trained_rank_head, metrics_from_ranks, ranking_report
from grstack.runtime.model import (
    BEST_MODEL,
    DATASET_DIR,
    ITEM_INIT_STD,
    ItemFeatureMap,
    build_model,
    initial_item_rows,
    item_feature_map,
    task_names,
)
from grstack.runtime.train import calibrate
from grstack.runtime.train import checkpoint as ckpt
from grstack.runtime.train.batching import BatchStream, Preparer, Schedule
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.lr_schedule import count_updates, learning_rate, window_bounds
from grstack.runtime.train.pipeline import Engine
from grstack.runtime.train.rundir import reclaim_unstarted
from grstack.runtime.train.shard_schedule import ShardSchedule
from grstack.runtime.train.sharded_eval import export_sharded, sharded_eval_ranks, sharded_rank_logits
from grstack.runtime.training_config import RANKING_PREFIX, Config, check_catalogue, dump_config

# Config sections (or fields) that must match for a checkpoint to be resumed.
RESUME_FIELDS = ("data", "model", "loss", "optim", "embedding", "balance", "train.batch_size", "train.seed",
                 "train.grad_accum_steps")
# Fields of those sections that may differ: they choose the split's cost weights when a run starts, and a
# resumed run splits by the weights its checkpoint holds (Trainer._balance_weights).
RESUME_FREE = ("balance.calibrate", "balance.profile")
_EMPTY_SPLIT = LeaveOneOut(SequenceDataset(  # a rank with no chunk left
    user_ids=np.zeros(0, np.int64), offsets=np.zeros(1, np.int64), item_ids=np.zeros(0, np.int64),
    timestamps=np.zeros(0, np.int64), num_items=0))
SHARD_DATASET = "dataset.json"  # data.read=shard: the dataset's fingerprint instead of a copy of it


@dataclass
class TrainState:
    """Where training stands; checkpointed with the parameters so a resumed run continues bit for bit."""

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0  # batches done
    updates: int = 0  # optimizer updates done (one per gradient-accumulation window)
    samples: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    best_metric: float = -1.0
    best_epoch: int = -1
    evals_since_best: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key, {}) if isinstance(tree, dict) else {}
    return tree


def changed_fields(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """Dotted paths whose values differ between two config trees, as ``path: old -> new``."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [line for k in [*saved, *(k for k in current if k not in saved)]
                for line in changed_fields(saved.get(k), current.get(k), f"{prefix}{k}.")]
    return [] if saved == current else [f"{prefix[:-1]}: {saved!r} -> {current!r}"]


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    diffs = []
    for path in RESUME_FIELDS:
        a, b = _get(saved, path), _get(current, path)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{path}.{k}" for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k) and f"{path}.{k}" not in RESUME_FREE]
        elif a != b:
            diffs.append(path)
    return diffs


@dataclass
class Built:
    model: nn.Module
    table: ShardedEmbedding
    engine: Engine
    schedule: Schedule
    preparer: Preparer


def build_engine(cfg: Config, ctx: DistContext, plan: ShardingPlan, split: LeaveOneOut | None, tasks: list[str],
                 *, num_items: int | None = None,
                 share: tuple[RankShare, list[list[np.ndarray]]] | None = None,
                 item_features: ItemFeatureMap | None = None, user_features: dict[str, int] | None = None) -> Built:
    """The dense model (its item rows live in this rank's shard), shard and dense optimizers, the engine and
    the batch schedule (over this rank's ``share`` and every rank's gathered lengths when the data is read
    sharded). Every rank builds the dense part from the same seed and initialises only its own
    rows of the item table, on its device; each row's initial value is a function of (seed, row id) alone,
    so a job's initial state does not depend on the number of ranks."""
    if num_items is None:
        assert split is not None
        num_items = split.ds.num_items
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, num_items, cfg.data.max_len, num_tasks=len(tasks), item_table=False,
                        item_features=item_features, user_features=user_features)
    mine = plan.shard_of(ctx.rank)
    shard = initial_item_rows(cfg.train.seed, plan.global_ids(mine, torch.arange(plan.shard_rows(mine))),
                              plan.dim, ITEM_INIT_STD, ctx.device)
    model = model.to(ctx.device)
    if ctx.rank > 0:  # dropout masks differ between ranks
        torch.manual_seed(cfg.train.seed * 1_000_003 + ctx.rank)
    o, e = cfg.optim, cfg.embedding
    opt = make_sparse_optimizer(e.optimizer, shard, e.lr or o.lr, (o.beta1, o.beta2), o.weight_decay)
    table = ShardedEmbedding(plan, ctx.rank, shard, opt)
    engine = Engine(cfg, ctx, model, table, ctx.device)
    extra = cfg.loss.ranking_candidates if engine.ranking else 0
    schedule: Schedule
    if share is not None:  # data.read=shard: this rank's share, every rank's lengths
        schedule = ShardSchedule(share[0], share[1], cfg, ctx.world_size, ctx.rank, extra)
    else:
        assert split is not None
        schedule = Schedule(split, cfg, ctx.world_size, extra)
    preparer = Preparer(schedule, cfg, ctx.rank, num_items, len(tasks), engine.ranking, item_features,
                        model.context)
    return Built(model, table, engine, schedule, preparer)


def make_plan(cfg: Config, ctx: DistContext, num_items: int,
              item_features: ItemFeatureMap | None = None, user_features: dict[str, int] | None = None
              ) -> ShardingPlan:
    """The item table's sharding: padding, the items, then the item and user side-feature values
    (model/side_features.py)."""
    rows = (num_items + 1 + (item_features.num_rows if item_features is not None else 0)
            + (sum(user_features.values()) if user_features else 0))
    return ShardingPlan.make(rows, cfg.model.d_model, ctx.world_size, ctx.group_size,
                             cfg.distributed.max_shard_rows)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, ctx: DistContext, *, progress: bool = True,
                 stop_after: int | None = None, heartbeat: Callable[..., None] | None = None) -> None:
        self.cfg, self.run_dir, self.ctx = cfg, Path(run_dir), ctx
        self.progress = progress and ctx.rank == 0
        self.stop_after = stop_after
        self.beat = heartbeat or (lambda step=None: None)
        self.device = ctx.device
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        configure_precision(self.device, cfg.train.precision, cfg.train.tf32)
        self.resume_path: Path | None = ctx.agree(self._decide)
        self.share: RankShare | None = None
        self.piece_lengths: list[list[np.ndarray]] = []
        if cfg.data.read == "shard":
            # only this rank's pieces are read; the other ranks' training lengths are gathered (not rows)
            self.ds = ctx.check_all(lambda: metadata_only(cfg.data.source))
            self.share = ctx.check_all(self._open_share)
            self.piece_lengths = list(ctx.world.all_gather_object(self.share.lengths))
            self.split = None
        else:
            if self.resume_path is not None:
                self.ds = ctx.check_all(lambda: read_dataset(self.run_dir / DATASET_DIR))
            else:
                self.ds = ctx.check_all(lambda: load_source(cfg.data))
            self.split = LeaveOneOut(self.ds, min_len=cfg.data.min_len, block=cfg.ranking_block())
        self.ds = select_features(self.ds, cfg.data)
        self.item_features = item_feature_map(self.ds)
        self.user_features = self.ds.user_features.sizes if self.ds.user_features is not None else None
        self.tasks = task_names(self.ds)
        if cfg.model.action_inputs and len(self.tasks) < 2:
            raise UserError(f"model.action_inputs: the dataset {self.ds.name} has no actions to read")
        self.plan = make_plan(cfg, ctx, self.ds.num_items, self.item_features, self.user_features)
        self._check_sizes()
        # balance.profile's fit, read on rank 0 for every rank before anything is written (a resumed run
        # takes its weights from its checkpoint instead)
        self.profile: dict[str, Any] | None = None
        if cfg.balance.profile is not None and self.resume_path is None:
            profile = cfg.balance.profile
            self.profile = ctx.agree(lambda: calibrate.read_profile(profile))

    # -- decisions made on rank 0 -------------------------------------------------------------------------
    def _decide(self) -> Path | None:
        d = self.run_dir
        if not d.exists() or not any(d.iterdir()):
            return None
        path = ckpt.latest(d)
        if path is None:
            if reclaim_unstarted(d, dump_config(self.cfg)):
                return None  # an earlier attempt of this config died before its first checkpoint
            if (d / "summary.json").exists():
                raise UserError(f"{d} holds a finished run; use a new --out directory")
            raise UserError(f"{d} exists, is not empty and holds no checkpoint to resume")
        manifest = ckpt.read_manifest(path)
        ckpt.check_layout(path, manifest, self.ctx.world_size, self.ctx.group_size)
        diffs = config_mismatch(manifest.get("config", {}), self.cfg.model_dump(mode="json"))
        if diffs:
            raise UserError(f"checkpoint {path} was written by another config ({', '.join(diffs)} differ); use a "
                            f"new --out directory")
        ckpt.remove_partial(d)
        return path

    def _open_share(self) -> RankShare:
        """This rank's pieces (dealt from the files' metadata); a resumed run first checks that the data is
        the data it started on."""
        d = self.cfg.data
        if self.resume_path is not None:
            recorded = json.loads((self.run_dir / SHARD_DATASET).read_text())
            if recorded != fingerprint(d.source):
                raise UserError(f"data.source {d.source} changed since this run started (its files or meta.json "
                                f"differ from {self.run_dir / SHARD_DATASET}); use a new --out directory")
        pieces = list_pieces(d.source, self.ctx.world_size)
        mine = deal(pieces, self.ctx.world_size)[self.ctx.rank]
        return RankShare(d.source, pieces, mine, min_len=d.min_len, max_len=d.max_len,
                         has_actions=self.ds.actions is not None, cache_pieces=2 * d.shuffle_window + 2,
                         block=self.cfg.ranking_block())

    def _train_rows(self) -> int:
        if self.split is not None:
            return len(self.split.train_users)
        return int(sum(len(x) for rank in self.piece_lengths for x in rank))

    def _check_sizes(self) -> None:
        check_catalogue(self.cfg, self.ds.num_items, f"data.source {self.cfg.data.source}")
        n = self._train_rows()
        W = self.ctx.world_size
        if n == 0:
            raise UserError(f"data.source {self.cfg.data.source}: no user has the >= 4 events training needs")
        if n < W:
            raise UserError(f"{n} training sequences cannot feed {W} ranks")
        if self.cfg.balance.token_budget is None and self.cfg.train.batch_size < W:
            raise UserError(f"train.batch_size={self.cfg.train.batch_size} is the global batch: it must be at "
                            f"least the number of ranks ({W})")

    def _prepare_run_dir(self) -> None:
        created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
            if self.cfg.data.read == "shard":  # no rank holds the data to copy: record what it was
                (self.run_dir / SHARD_DATASET).write_text(json.dumps(fingerprint(self.cfg.data.source), indent=2))
            else:
                write_dataset(self.ds, self.run_dir / DATASET_DIR)
        except OSError as exc:
            if created:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise UserError(f"cannot write the run directory {self.run_dir}: {exc}") from None

    def _record_resumed_config(self) -> None:
        """A resume may change the fields a checkpoint does not pin (epochs, patience, evaluation, logging):
        the run directory's config.yaml then says what the run continues under, and the change is printed."""
        path = self.run_dir / "config.yaml"
        text = dump_config(self.cfg)
        try:
            old = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            old = None
        changes = changed_fields(old, self.cfg.model_dump(mode="json")) if isinstance(old, dict) else []
        try:
            path.write_text(text)
        except OSError as exc:
            raise UserError(f"cannot write the run directory {self.run_dir}: {exc}") from None
        if changes and self.progress:
            print(f"resuming {self.resume_path} with changed settings: {'; '.join(changes)}", file=sys.stderr)

    # -- set-up ---------------------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        b = build_engine(cfg, ctx, self.plan, self.split, self.tasks, num_items=self.ds.num_items,
                         share=(self.share, self.piece_lengths) if self.share is not None else None,
                         item_features=self.item_features, user_features=self.user_features)
        self.model, self.table, self.engine = b.model, b.table, b.engine
        self.schedule, self.preparer = b.schedule, b.preparer
        self.balance = self._balance_weights()
        self.schedule.set_weights(self.balance["cost_a"], self.balance["cost_b"])
        t = cfg.train
        self.total_updates = count_updates([self.schedule.steps_in_epoch(e) for e in range(t.epochs)],
                                           t.grad_accum_steps, t.max_steps)
        self.state = TrainState()
        # the best evaluation's dense weights (every rank) and this rank's shard of its item table
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_shard: torch.Tensor | None = None
        if self.resume_path is not None:
            dense = ckpt.load_dense(self.resume_path)
            part = ckpt.load_part(self.resume_path, ctx.rank)
            self.model.load_state_dict(dense["model"])
            self.engine.optimizer.load_state_dict(dense["optimizer"])
            self.state = TrainState(**{"updates": dense["state"]["global_step"], **dense["state"]})
            self.table.weight.copy_(part["shard"])
            self.table.optimizer.load_state_dict(part["sparse_optimizer"])
            torch.set_rng_state(part["rng"])
            if self.device.type == "cuda" and "device_rng" in part:
                torch.cuda.set_rng_state(part["device_rng"], self.device)
            if ctx.rank == 0:
                self._trim_metrics(self.state.global_step)
            if self.state.best_epoch >= 0:
                self._restore_best(dense.get("best_state"), part.get("best_shard"))

    def _restore_best(self, best: dict[str, torch.Tensor] | None, shard: torch.Tensor | None) -> None:
        """The checkpoint's best state: dense weights, and this rank's shard (from its part; a checkpoint
        written before export was sharded holds the whole best table in ``best_state``: its rows of it)."""
        if best is None:
            return
        best = dict(best)
        table = best.pop("item_emb.weight", None)
        if table is not None:
            self.table.note_rows(table.shape[0])
            shard = table[self.table.shard_index :: self.plan.group_size].clone()
        self.best_state = best
        self.best_shard = None if shard is None else shard.to(self.table.weight.device)

    def _balance_weights(self) -> dict[str, Any]:
        """The cost weights this run splits by, the same on every rank: ``cost_a``, ``cost_b``, ``source``
        (``config``, ``profile``, ``calibrated``) and ``fitted`` (the fit they come from, or None). A resumed
        run takes its checkpoint's (a checkpoint from before calibration existed: the config's, which that
        run split by), so it repeats the interrupted run's splits whatever the timings would say now."""
        ctx, bal = self.ctx, self.cfg.balance
        config: dict[str, Any] = {"cost_a": bal.cost_a, "cost_b": bal.cost_b, "source": "config", "fitted": None}
        if self.resume_path is not None:
            return ckpt.read_manifest(self.resume_path).get("balance", config)
        if self.profile is not None:
            fitted, source = self.profile, "profile"
        elif bal.calibrate and ctx.world_size > 1 and bal.mode == "tokens":
            # one rank has nothing to split, and equal counts do not use the weights: no timing there
            fitted, source = calibrate.calibrate(self.engine, self.schedule, self.preparer, ctx), "calibrated"
        else:
            return config
        w = calibrate.weights(fitted["a"], fitted["b"])
        if w is None:  # no cost grew with length (or too few distinct lengths to fit): the config's weights
            return {**config, "fitted": fitted}
        if self.progress:
            r2 = fitted.get("r2", float("nan"))
            print(f"balance: {source} fit a={fitted['a']:.4g}, b={fitted['b']:.4g} (R2 {r2:.3f}); splitting by "
                  f"cost_a={w[0]:.4g}, cost_b={w[1]:.4g} (config: {bal.cost_a:g}, {bal.cost_b:g})", file=sys.stderr)
        return {"cost_a": w[0], "cost_b": w[1], "source": source, "fitted": fitted}

    def _trim_metrics(self, step: int) -> None:
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            keep = [x for x in path.read_text().splitlines() if x and json.loads(x)["step"] <= step]
            path.write_text("".join(k + "\n" for k in keep))

    # -- evaluation (sharded: no rank holds more of the item table than its shard) ----------------------------
    def _eval_parts(self) -> Iterator[tuple[LeaveOneOut, np.ndarray]]:
        """(split, rows) pairs this rank evaluates, as many on every rank. All data on every rank: one pair,
        the users dealt round-robin. Sharded data: this rank's users, a chunk of pieces at a time (read when
        its turn comes), padded with empty pairs to the largest rank's chunk count; ``eval.max_users`` keeps
        the same share of every chunk's users."""
        e, ctx = self.cfg.eval, self.ctx
        if self.split is not None:
            rows = np.arange(self.split.num_users)
            if e.max_users is not None and e.max_users < len(rows):
                rows = np.sort(np.random.default_rng(0).choice(rows, size=e.max_users, replace=False))
            yield self.split, rows[ctx.rank :: ctx.world_size]
            return
        assert self.share is not None
        chunks = self.share.eval_splits(self.cfg.data.shuffle_window)
        n = max(int(c) for c in ctx.world.meta.all_gather_sizes(len(chunks)))
        total = self._num_users()
        keep = 1.0 if e.max_users is None or e.max_users >= total else e.max_users / total
        for i in range(n):
            if i >= len(chunks):
                yield _EMPTY_SPLIT, np.zeros(0, dtype=np.int64)
                continue
            split = self.share.chunk_split(chunks[i])
            rows = np.arange(split.num_users)
            if keep < 1.0:
                rng = np.random.default_rng([0, ctx.rank, i])
                rows = np.flatnonzero(rng.random(len(rows)) < keep)
            yield split, rows

    def _num_users(self) -> int:
        if self.split is not None:
            return self.split.num_users
        assert self.share is not None
        return int(sum(self.ctx.world.meta.all_gather_sizes(self.share.num_users)))

    def _data_report(self) -> dict[str, Any]:
        """How the data was read: ``events_read_fraction`` per rank is the share of all events in the distinct
        pieces that rank decoded (every rank reads everything with ``data.read: all``)."""
        if self.share is None:
            return {"read": "all", "events_read_fraction_max": 1.0}
        sh = self.share
        mine = {"events_read": sh.events_read, "events_decoded": sh.events_decoded, "pieces": len(sh.mine),
                "cache_peak_pieces": sh.cache_peak}
        ranks = self.ctx.world.all_gather_object(mine)
        total = max(1, int(read_meta(sh.path).get("num_events") or sum(p.events for p in sh.pieces)))
        fractions = [r["events_read"] / total for r in ranks]
        assert isinstance(self.schedule, ShardSchedule)
        return {"read": "shard", "pieces": len(sh.pieces), "events_total": total,
                "events_read_fraction": fractions, "events_read_fraction_max": max(fractions),
                "events_decoded": [r["events_decoded"] for r in ranks],
                "cache_peak_pieces": max(r["cache_peak_pieces"] for r in ranks),
                "rows_dropped_per_epoch": dict(sorted(self.schedule.dropped.items()))}

    def _evaluate(self, which: str, model: nn.Module, shard: torch.Tensor | None = None) -> dict[str, float]:
        """Metrics of the dense ``model`` with the item table's shards (``shard``: this rank's rows to use
        instead of the table's), over the users of ``_eval_parts`` (sharded_eval_ranks). With the whole data on
        every rank the ranks are put back in row order, so the metrics equal ``evaluate``'s on the same users."""
        e, ctx = self.cfg.eval, self.ctx
        mine = [sharded_eval_ranks(model, self.table, ctx, split, which, rows, max_len=self.cfg.data.max_len,
                                   batch_size=e.batch_size, device=self.device, tick=self.beat, weight=shard)
                for split, rows in self._eval_parts()]
        gathered = ctx.world.all_gather_object(mine)
        if self.split is not None:  # one part per rank: rank r ranked rows r::W
            W = ctx.world_size
            ranks = np.zeros(sum(len(part[0]) for part in gathered), dtype=np.int64)
            for r, part in enumerate(gathered):
                ranks[r::W] = np.asarray(part[0])
        else:
            ranks = np.concatenate([np.asarray(x) for part in gathered for x in part] + [np.zeros(0, np.int64)])
        return metrics_from_ranks(ranks, e.ks)

    def _evaluate_ranking(self, which: str, model: nn.Module, shard: torch.Tensor | None = None
                          ) -> dict[str, Any] | None:
        """Per task, the ranking head's AUC, GAUC and NE on candidate sets like training's (or held-out blocks of
        logged exposures, ``loss.ranking_on=exposures``), over the same users
        as ``_evaluate`` (each rank scores its own; every rank gets the report). None without a ranking head;
        ``{"skipped": why}`` when the head was not trained."""
        if getattr(model, "rank_head", None) is None:
            return None
        why = has_trained_rank_head(model, self.cfg.loss.ranking_weight)
        if why is not None:
            return {"skipped": why}
        e, ctx = self.cfg.eval, self.ctx
        mine = [sharded_rank_logits(model, self.table, ctx, split, which, rows, max_len=self.cfg.data.max_len,
                                    batch_size=e.batch_size, device=self.device,
                                    num_candidates=self.cfg.loss.ranking_candidates, seed=self.cfg.train.seed,
                                    num_items=self.ds.num_items, tick=self.beat, weight=shard,
                                    ranking_on=self.cfg.loss.ranking_on)
                for split, rows in self._eval_parts()]
        parts = [p for rank in ctx.world.all_gather_object(mine) for p in rank]
        labels = np.concatenate([p[0] for p in parts])
        logits = np.concatenate([p[1] for p in parts])
        return ranking_report(labels, logits, self.tasks, self.cfg.loss.ranking_on)

    # -- bookkeeping ----------------------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if self.ctx.rank == 0:
            with (self.run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _report(self, fields: dict[str, Any]) -> None:
        if self.ctx.rank != 0:
            return
        try:
            from grstack.runtime.train.progress import report_progress
        except ImportError:
            return
        report_progress({"step": self.state.global_step, "epoch": self.state.epoch,
                         "total_steps": self.schedule.total_steps(), **fields})

    def _lr(self, update: int) -> float:
        return learning_rate(update, self.total_updates, self.cfg.optim)

    def _save(self) -> Path:
        self.engine.settle()  # the engine's collectives are done before this thread issues its own
        cfg, ctx = self.cfg, self.ctx
        manifest = {**self.plan.describe(), "config": cfg.model_dump(mode="json"), "balance": self.balance}
        dense = {"model": self.model.state_dict(), "optimizer": self.engine.optimizer.state_dict(),
                 "state": self.state.__dict__, "best_state": self.best_state} if ctx.rank == 0 else {}
        part = {"shard": self.table.weight, "sparse_optimizer": self.table.optimizer.state_dict(),
                "rng": torch.get_rng_state(), "best_shard": self.best_shard}
        if self.device.type == "cuda":  # dropout on the device draws from the device's generator
            part["device_rng"] = torch.cuda.get_rng_state(self.device)
        path = ckpt.save(ctx, self.run_dir, self.state.global_step, manifest, dense, part,
                          cfg.train.keep_checkpoints)
        profile = self.run_dir / calibrate.PROFILE
        if ctx.rank == 0 and self.balance["source"] == "calibrated" and not profile.exists():
            # after the first checkpoint: until then the run directory holds only what a restart may clear
            calibrate.write_profile(profile, self.balance["fitted"])
        self._report({"last_checkpoint": str(path)})
        self.beat()
        return path

    # -- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        if self.resume_path is None:
            self.ctx.agree(self._prepare_run_dir)
        else:
            self.ctx.agree(self._record_resumed_config)
        self._build()
        try:
            return self._loop()
        finally:
            self.engine.close()

    def _loop(self) -> dict[str, Any]:
        cfg, st, ctx = self.cfg, self.state, self.ctx
        total = self.schedule.total_steps()
        accum = cfg.train.grad_accum_steps
        stream = BatchStream(self.schedule.positions(st.epoch, st.step_in_epoch, st.global_step), self.preparer,
                             cfg.negatives.prefetch, cfg.negatives.background, device=self.device)
        from tqdm import tqdm

        bar = tqdm(total=total, initial=st.global_step, disable=not self.progress, file=sys.stderr, unit="step",
                   dynamic_ncols=True, desc=cfg.name if ctx.world_size == 1 else f"{cfg.name} x{ctx.world_size}")
        window: dict[str, float] = {"t": 0.0, "samples": 0, "tokens": 0}
        self.totals = {"imbalance": 0.0, "imbalance_count_split": 0.0, "wait_ratio_measured": 0.0,
                       "imbalance_measured": 0.0, "exposed_comm_ms": 0.0, "comm_ms": 0.0,
                       "stale_rows": 0, "steps": 0, "host_syncs": 0, "sync_steps": 0}
        self.sync_counter: str | None = None
        stopped_early = False
        # CUDA's sync debug mode around each step (exact and cheap); the CPU proxy (a dispatch mode over every
        # operator) would slow training, and `grstack bench train` reports it
        self.engine.count_host_syncs = self.device.type == "cuda"
        try:
            while not stopped_early:
                # a step's time includes waiting for (or, inline, preparing) its batch
                t0 = time.perf_counter()
                batch = stream.next()
                if batch is None:
                    break
                # the accumulation window of this batch: updates (and checkpoints, stops) only at its end
                first, end = window_bounds(st.step_in_epoch, self.schedule.steps_in_epoch(st.epoch), accum)
                size = min(end - first, total - (st.global_step - (st.step_in_epoch - first)))
                boundary = st.step_in_epoch + 1 == end or st.global_step + 1 == total
                stopping = boundary and self.stop_after is not None and st.global_step + 1 >= self.stop_after
                upcoming = None if stopping or not self.engine.prefetching else stream.peek()
                data_wait = time.perf_counter() - t0
                lr = self._lr(st.updates)
                out = self.engine.step(batch, upcoming, lr, update=boundary, grad_scale=1.0 / size)
                if out.get("host_syncs") is not None:
                    self.totals["host_syncs"] += out["host_syncs"]
                    self.totals["sync_steps"] += 1
                    self.sync_counter = out["host_syncs_counter"]
                out["data_wait_ms"] = 1e3 * data_wait
                dt = time.perf_counter() - t0
                self.beat(st.global_step + 1)
                st.train_seconds += dt
                st.samples += out["samples"]
                st.tokens += out["tokens"]
                st.step_in_epoch += 1
                st.global_step += 1
                st.updates += int(boundary)
                window["t"] += dt
                window["samples"] += out["samples"]
                window["tokens"] += out["tokens"]
                for k in ("imbalance", "imbalance_count_split", "wait_ratio_measured", "imbalance_measured",
                          "exposed_comm_ms", "comm_ms", "stale_rows"):
                    self.totals[k] += out[k]
                self.totals["steps"] += 1
                if not np.isfinite(out["loss"]):
                    raise RuntimeError(f"loss is {out['loss']} at step {st.global_step}; lower optim.lr")
                bar.update(1)
                epoch_done = st.step_in_epoch == self.schedule.steps_in_epoch(st.epoch)
                if st.global_step % cfg.train.log_every == 0 or epoch_done or st.global_step == total:
                    rec = {"kind": "train", "step": st.global_step, "epoch": st.epoch, "loss": out["loss"],
                           "retrieval_loss": out["retrieval_loss"], "ranking_loss": out["ranking_loss"],
                           "lr": lr, "updated": boundary,
                           "samples_per_second": window["samples"] / max(window["t"], 1e-9),
                           "tokens_per_second": window["tokens"] / max(window["t"], 1e-9),
                           # timing fields: Engine.step's docstring; imbalance, imbalance_count_split and
                           # wait_ratio are the cost model's, the *_measured ones come from busy times
                           **{k: out[k] for k in ("step_ms", "data_wait_ms", "compute_ms", "exposed_comm_ms",
                                                  "comm_ms", "collective_ms", "sparse_update_ms",
                                                  "busy_ms", "busy_ms_max", "sync_wait_ms",
                                                  "wait_ratio_measured", "imbalance_measured",
                                                  "microbatches", "unique_keys_per_microbatch",
                                                  "imbalance", "imbalance_count_split", "wait_ratio",
                                                  "refreshed_rows", "stale_rows", "staleness")}}
                    self._log(rec)
                    self._report({k: rec[k] for k in ("loss", "samples_per_second", "tokens_per_second")})
                    bar.set_postfix(loss=f"{out['loss']:.4f}", sps=f"{rec['samples_per_second']:.0f}")
                    window = {"t": 0.0, "samples": 0, "tokens": 0}
                if epoch_done:
                    st.epoch += 1
                    st.step_in_epoch = 0
                    if st.epoch % cfg.train.eval_every_epochs == 0 or st.epoch == cfg.train.epochs:
                        stopped_early = self._epoch_eval()
                    if stopped_early:
                        self.engine.drain()
                    self._save()
                elif (cfg.train.checkpoint_every and boundary
                      and st.global_step // cfg.train.checkpoint_every
                      > (st.global_step - size) // cfg.train.checkpoint_every):
                    self._save()  # the first window end at or after each multiple of checkpoint_every
                elif stopping:
                    self._save()
                if stopping:
                    bar.close()
                    return {"stopped_at_step": st.global_step}
        finally:
            stream.close()
            bar.close()
        self.engine.drain()
        if st.step_in_epoch and self.totals["steps"] and not stopped_early:
            # train.max_steps ended the run inside an epoch: evaluate and keep what its last steps trained
            self._epoch_eval()
            self._save()
        if st.best_epoch < 0:
            self._epoch_eval()
        return self._finish()

    def _epoch_eval(self) -> bool:
        self.engine.settle()  # the engine's collectives are done before evaluation issues its own
        st, cfg = self.state, self.cfg
        model = self.model
        metrics = self._evaluate("valid", model)
        sel = cfg.train.select_metric
        if sel.startswith(RANKING_PREFIX):  # a ranking-head metric: the validation ranking report's
            metrics[sel] = self._ranking_select_value(model, sel)
        value = metrics[sel]
        rec = {"kind": "eval", "split": "valid", "step": st.global_step, "epoch": st.epoch, **metrics}
        st.history.append(rec)
        self._log(rec)
        if self.progress:
            print(f"epoch {st.epoch}: valid " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                  file=sys.stderr)
        if value > st.best_metric:
            st.best_metric, st.best_epoch, st.evals_since_best = value, st.epoch, 0
            self.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.best_shard = self.table.weight.detach().clone()
            export_sharded(model, self.best_shard, self.table, self.ctx, cfg, self.ds, self.run_dir / BEST_MODEL,
                           st.global_step)
            return False
        st.evals_since_best += 1
        return cfg.train.patience is not None and st.evals_since_best >= cfg.train.patience

    def _ranking_select_value(self, model: nn.Module, sel: str) -> float:
        """``ranking.TASK.METRIC`` of the validation ranking report (-inf where it is undefined: one class)."""
        _, task, metric = sel.split(".")
        ranking = self._evaluate_ranking("valid", model)
        if ranking is None or "skipped" in ranking:
            raise UserError(f"train.select_metric {sel} needs a trained ranking head")
        if task not in ranking:
            raise UserError(f"train.select_metric {sel}: the ranking report has no task {task!r} "
                            f"(tasks: {', '.join(ranking)})")
        v = ranking[task][metric]
        return float(v) if isinstance(v, (int, float)) else float("-inf")

    def _finish(self) -> dict[str, Any]:
        st, cfg, ctx = self.state, self.cfg, self.ctx
        model, shard = self.model, None
        if self.progress:
            print(f"evaluation: the best model (epoch {st.best_epoch}) on the validation and test users",
                  file=sys.stderr, flush=True)
        if self.best_state is not None and self.best_shard is not None:
            model, shard = copy.deepcopy(self.model), self.best_shard
            model.load_state_dict(self.best_state)
        results: dict[str, dict[str, Any]] = {which: dict(self._evaluate(which, model, shard))
                                              for which in ("valid", "test")}
        for which in ("valid", "test"):
            ranking = self._evaluate_ranking(which, model, shard)
            if ranking is not None:
                results[which]["ranking"] = ranking
        n = max(1, self.totals["steps"])
        # the largest item-table tensor any rank held (its shard, any gathered table), in rows
        rows_held = max(int(x) for x in ctx.world.all_gather_object(self.table.rows_held_max))
        summary = {
            "model": cfg.model.type,
            "dataset": self.ds.name,
            "config": cfg.name,
            "steps": st.global_step,
            "epochs": st.epoch,
            "best_epoch": st.best_epoch,
            "train_seconds": st.train_seconds,
            "samples_per_second": st.samples / max(st.train_seconds, 1e-9),
            "tokens_per_second": st.tokens / max(st.train_seconds, 1e-9),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "num_users": self._num_users(),
            "num_items": self.ds.num_items,
            "metrics": results,
            "model_path": str(self.run_dir / BEST_MODEL),
            "distributed": {
                "world_size": ctx.world_size,
                "sparse_group_size": ctx.group_size,
                "backend": ctx.backend,
                "pipeline": cfg.pipeline.model_dump(),
                "balance": cfg.balance.mode,
                # the cost model's per-rank cost a·L + b·L² (split used, and equal counts), not measured
                "mean_imbalance": self.totals["imbalance"] / n,
                "mean_imbalance_count_split": self.totals["imbalance_count_split"] / n,
                # from every rank's measured busy time per step (Engine.step)
                "mean_wait_ratio_measured": self.totals["wait_ratio_measured"] / n,
                "mean_imbalance_measured": self.totals["imbalance_measured"] / n,
                # the same communication events in both (grstack.runtime.train.timing)
                "exposed_comm_ratio": self.totals["exposed_comm_ms"] / max(self.totals["comm_ms"], 1e-9),
                "stale_rows": self.totals["stale_rows"],
                "table_rows_max": rows_held,
                "table_rows_fraction_max": rows_held / self.plan.num_rows,
            },
            # the cost weights the split used and where they came from (calibrate.py: the fit)
            "balance": {"mode": cfg.balance.mode, **self.balance},
            "precision": cfg.train.precision,
            "grad_accum_steps": cfg.train.grad_accum_steps,
            "optimizer_updates": st.updates,
            # per step, as host_syncs_counter counts them (CUDA's sync debug mode); None off CUDA
            "host_syncs_per_step": (self.totals["host_syncs"] / self.totals["sync_steps"]
                                    if self.totals["sync_steps"] else None),
            "host_syncs_counter": self.sync_counter,
            "data": self._data_report(),
        }
        if ctx.rank == 0:
            tmp = self.run_dir / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            tmp.replace(self.run_dir / "summary.json")
            try:
                from grstack.runtime.train.plot import plot_training_curves

                plot_training_curves(self.run_dir / "metrics.jsonl", self.run_dir / "training_curve.png",
                                     title=f"{cfg.name}: {cfg.model.type} on {self.ds.name}"
                                           + (f", {ctx.world_size} ranks" if ctx.world_size > 1 else ""))
            except ImportError:
                pass
            self._report({"finished": True,
                          "metrics": {k: v for k, v in results["test"].items() if k != "ranking"}})
        ctx.world.barrier()
        return summary


def train(cfg: Config, run_dir: str | Path, *, progress: bool = True, stop_after: int | None = None
          ) -> dict[str, Any]:
    """Trains in this process as a world of one rank; returns the summary (or ``{"stopped_at_step": N}``)."""
    from grstack.runtime.device import resolve_device

    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    ctx = DistContext.single(resolve_device(cfg.train.device), cfg.distributed.sparse_group_size,
                             cfg.distributed.timeout_s)
    return Trainer(cfg, run_dir, ctx, progress=progress, stop_after=stop_after).run()

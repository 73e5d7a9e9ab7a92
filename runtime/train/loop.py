"""Single-process training: jagged batches, sampled softmax (+ ranking head), AdamW, exact resume.

Everything that decides the next step — parameters, optimizer moments, the global torch RNG (dropout), the
negative sampler's generator, the epoch and the step inside it — is checkpointed, and each epoch's order is
a pure function of (seed, epoch); so a resumed run continues the same loss curve bit for bit.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.dataset import read_dataset, write_dataset
from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.device import resolve_device, synchronize
from grstack.runtime.errors import UserError
from grstack.runtime.eval.evaluate import evaluate
from grstack.runtime.model import (
    BEST_MODEL,
    DATASET_DIR,
    build_model,
    export_model,
    load_checkpoint,
    task_names,
)
from grstack.runtime.train import checkpoint as ckpt
from grstack.runtime.train.loss import (
    negative_shape,
    ranking_bce_loss,
    sample_negatives,
    sampled_softmax_loss,
)
from grstack.runtime.train.rundir import reclaim_unstarted
from grstack.runtime.training_config import Config, dump_config

CHECKPOINT_VERSION = 1
# Config sections that must match for a checkpoint to be resumed.
RESUME_FIELDS = ("data", "model", "loss", "optim", "train.batch_size", "train.seed")


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree[key]
    return tree


def _config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    diffs = []
    for path in RESUME_FIELDS:
        a, b = _get(saved, path), _get(current, path)
        if isinstance(a, dict):
            diffs += [f"{path}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(path)
    return diffs


@dataclass
class TrainState:
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    best_metric: float = -1.0
    best_epoch: int = -1
    evals_since_best: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, *, progress: bool = True,
                 stop_after: int | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.stop_after = stop_after
        self.device = resolve_device(cfg.train.device)
        if cfg.train.num_threads:
            torch.set_num_threads(cfg.train.num_threads)
        resume = ckpt.latest_checkpoint(self.run_dir) if self.run_dir.is_dir() else None
        self.resume_blob = load_checkpoint(resume) if resume else None
        if self.resume_blob is not None:
            diffs = _config_mismatch(self.resume_blob["config"], cfg.model_dump(mode="json"))
            if diffs:
                raise UserError(f"checkpoint {resume} was written by another config ({', '.join(diffs)} "
                                f"differ); use a new --out directory")
            self.ds = read_dataset(self.run_dir / DATASET_DIR)
        else:
            self._check_fresh_dir()
            self.ds = load_source(cfg.data)
        self.split = LeaveOneOut(self.ds, min_len=cfg.data.min_len)
        if len(self.split.train_users) == 0:
            raise UserError(f"data.source {cfg.data.source}: no user has the >= 4 events training needs")
        self.tasks = task_names(self.ds)

    def _check_fresh_dir(self) -> None:
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            if reclaim_unstarted(self.run_dir, dump_config(self.cfg)):
                return
            if (self.run_dir / "summary.json").exists():
                raise UserError(f"{self.run_dir} holds a finished run; use a new --out directory")
            from grstack.runtime.train.dist_checkpoint import latest as latest_sharded

            if latest_sharded(self.run_dir) is not None:
                raise UserError(f"{self.run_dir} holds checkpoints of a multi-rank run; resume it with --nproc")
            raise UserError(f"{self.run_dir} exists, is not empty and holds no checkpoint to resume")

    # -- set-up -------------------------------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
            write_dataset(self.ds, self.run_dir / DATASET_DIR)
        except BaseException:
            if created:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, self.ds.num_items, cfg.data.max_len,
                                 num_tasks=len(self.tasks)).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.optim.lr,
                                           betas=(cfg.optim.beta1, cfg.optim.beta2),
                                           weight_decay=cfg.optim.weight_decay)
        self.neg_gen = torch.Generator().manual_seed(cfg.train.seed + 1)
        self.state = TrainState()
        if self.resume_blob is not None:
            blob = self.resume_blob
            self.model.load_state_dict(blob["model"])
            self.optimizer.load_state_dict(blob["optimizer"])
            torch.set_rng_state(blob["rng"]["torch"])
            self.neg_gen.set_state(blob["rng"]["negatives"])
            self.state = TrainState(**blob["state"])
            self._trim_metrics(self.state.global_step)

    def _trim_metrics(self, step: int) -> None:
        """Drops records written after the checkpoint we resume from, so the log is one continuous curve."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(k + "\n" for k in keep))

    # -- steps --------------------------------------------------------------------------------------
    def steps_per_epoch(self) -> int:
        return -(-len(self.split.train_users) // self.cfg.train.batch_size)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.split.train_users))

    def _lr(self, step: int) -> float:
        warm = self.cfg.optim.warmup_steps
        return self.cfg.optim.lr * min(1.0, (step + 1) / warm) if warm else self.cfg.optim.lr

    def train_step(self, rows: np.ndarray) -> dict[str, float]:
        cfg = self.cfg
        batch, target_ts = self.split.train_batch(rows, cfg.data.max_len)
        rank_on = getattr(self.model, "rank_head", None) is not None and cfg.loss.ranking_weight > 0
        if rank_on:
            last = batch.offsets[1:] - 1
            B, M = batch.batch_size, cfg.loss.ranking_candidates
            negs = sample_negatives(self.ds.num_items, (B, M - 1), self.neg_gen, torch.device("cpu"))
            cand = torch.cat([batch.targets[last][:, None], negs], dim=1)
            full, is_hist = append_candidates(batch, cand, target_ts[last])
            labels = torch.zeros(B, M, len(self.tasks))
            labels[:, 0, 0] = 1.0
            if batch.actions is not None:
                bits = batch.actions[last]
                for t in range(1, len(self.tasks)):
                    labels[:, 0, t] = ((bits >> (t - 1)) & 1).float()
        else:
            full, is_hist = batch, None
        full = full.to(self.device)
        targets = batch.targets.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.state.global_step)
        out = self.model.encode(full)
        hist_out = out[is_hist.to(self.device)] if is_hist is not None else out
        q = self.model.query_vectors(hist_out)
        pos = self.model.item_vectors(targets)
        shape = negative_shape(cfg.loss.sharing, targets.numel(), cfg.loss.negatives, cfg.loss.group_size)
        neg_ids = sample_negatives(self.ds.num_items, shape, self.neg_gen, self.device)
        neg = self.model.item_vectors(neg_ids)
        loss = sampled_softmax_loss(q, pos, neg, targets, neg_ids, cfg.loss.temperature)
        parts = {"retrieval_loss": loss.item()}
        if rank_on:
            cand_out = out[~is_hist.to(self.device)]
            logits = self.model.rank_logits(cand_out, cand.reshape(-1).to(self.device))
            rl = ranking_bce_loss(logits, labels.reshape(-1, len(self.tasks)).to(self.device))
            parts["ranking_loss"] = rl.item()
            loss = loss + cfg.loss.ranking_weight * rl
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
        self.optimizer.step()
        return {"loss": loss.item(), **parts, "samples": batch.batch_size, "tokens": batch.num_tokens}

    # -- bookkeeping --------------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _save(self) -> Path:
        blob = {
            "version": CHECKPOINT_VERSION,
            "config": self.cfg.model_dump(mode="json"),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "negatives": self.neg_gen.get_state()},
            "state": self.state.__dict__,
        }
        path = ckpt.save_checkpoint(self.run_dir, self.state.global_step, blob, self.cfg.train.keep_checkpoints)
        self._report({"last_checkpoint": str(path)})
        return path

    def _report(self, fields: dict[str, Any]) -> None:
        try:
            from grstack.runtime.train.progress import report_progress
        except ImportError:
            return
        report_progress({"step": self.state.global_step, "epoch": self.state.epoch,
                         "total_steps": self.total_steps(), **fields})

    def total_steps(self) -> int:
        total = self.steps_per_epoch() * self.cfg.train.epochs
        return min(total, self.cfg.train.max_steps) if self.cfg.train.max_steps else total

    def _evaluate(self, which: str, max_users: int | None = None) -> dict[str, float]:
        e = self.cfg.eval
        return evaluate(self.model, self.split, which, max_len=self.cfg.data.max_len, ks=e.ks,
                        batch_size=e.batch_size, device=self.device, max_users=max_users)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        if self.resume_blob is None:
            self._prepare_run_dir()
        self._build()
        cfg, st = self.cfg, self.state
        total = self.total_steps()
        steps_per_epoch = self.steps_per_epoch()
        ckpt_every = cfg.train.checkpoint_every
        from tqdm import tqdm

        bar = tqdm(total=total, initial=st.global_step, disable=not self.progress, file=sys.stderr,
                   unit="step", dynamic_ncols=True, desc=cfg.name)
        stopped_early = False
        window_t, window_samples, window_tokens = 0.0, 0, 0
        while st.epoch < cfg.train.epochs and st.global_step < total and not stopped_early:
            order = self._epoch_order(st.epoch)
            self.model.train()
            while st.step_in_epoch < steps_per_epoch and st.global_step < total:
                lo = st.step_in_epoch * cfg.train.batch_size
                rows = order[lo : lo + cfg.train.batch_size]
                t0 = time.perf_counter()
                out = self.train_step(rows)
                synchronize(self.device)
                dt = time.perf_counter() - t0
                st.train_seconds += dt
                st.samples += out["samples"]
                st.tokens += out["tokens"]
                st.step_in_epoch += 1
                st.global_step += 1
                window_t += dt
                window_samples += out["samples"]
                window_tokens += out["tokens"]
                if not np.isfinite(out["loss"]):
                    raise RuntimeError(f"loss is {out['loss']} at step {st.global_step}; lower optim.lr")
                bar.update(1)
                if st.global_step % cfg.train.log_every == 0 or st.step_in_epoch == steps_per_epoch:
                    rec = {"kind": "train", "step": st.global_step, "epoch": st.epoch,
                           "loss": out["loss"], "retrieval_loss": out["retrieval_loss"],
                           "ranking_loss": out.get("ranking_loss"), "lr": self._lr(st.global_step - 1),
                           "samples_per_second": window_samples / max(window_t, 1e-9),
                           "tokens_per_second": window_tokens / max(window_t, 1e-9)}
                    self._log(rec)
                    self._report({k: rec[k] for k in ("loss", "samples_per_second", "tokens_per_second")})
                    bar.set_postfix(loss=f"{out['loss']:.4f}", sps=f"{rec['samples_per_second']:.0f}")
                    window_t, window_samples, window_tokens = 0.0, 0, 0
                if ckpt_every and st.global_step % ckpt_every == 0 and st.step_in_epoch < steps_per_epoch:
                    self._save()
                if self.stop_after is not None and st.global_step >= self.stop_after:
                    self._save()
                    bar.close()
                    return {"stopped_at_step": st.global_step}
            if st.step_in_epoch == steps_per_epoch:
                st.epoch += 1
                st.step_in_epoch = 0
                if st.epoch % cfg.train.eval_every_epochs == 0 or st.epoch == cfg.train.epochs:
                    stopped_early = self._epoch_eval()
                self._save()
        bar.close()
        if st.best_epoch < 0:  # max_steps ended inside the first epoch: evaluate what we have
            self._epoch_eval()
        return self._finish()

    def _epoch_eval(self) -> bool:
        """Validation after an epoch; keeps the best model; True when patience is exhausted."""
        st, cfg = self.state, self.cfg
        metrics = self._evaluate("valid")
        value = metrics[cfg.train.select_metric]
        rec = {"kind": "eval", "split": "valid", "step": st.global_step, "epoch": st.epoch, **metrics}
        st.history.append(rec)
        self._log(rec)
        if self.progress:
            print(f"epoch {st.epoch}: valid " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()),
                  file=sys.stderr)
        if value > st.best_metric:
            st.best_metric, st.best_epoch, st.evals_since_best = value, st.epoch, 0
            export_model(self.model, cfg, self.ds, self.run_dir / BEST_MODEL)
            return False
        st.evals_since_best += 1
        return cfg.train.patience is not None and st.evals_since_best >= cfg.train.patience

    def _finish(self) -> dict[str, Any]:
        st, cfg = self.state, self.cfg
        best = self.run_dir / BEST_MODEL
        if best.exists():
            self.model.load_state_dict(load_checkpoint(best)["state_dict"])
        results = {which: self._evaluate(which) for which in ("valid", "test")}
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
            "num_users": self.split.num_users,
            "num_items": self.ds.num_items,
            "metrics": results,
            "model_path": str(best),
        }
        tmp = self.run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.run_dir / "summary.json")
        try:
            from grstack.runtime.train.plot import plot_training_curves

            plot_training_curves(self.run_dir / "metrics.jsonl", self.run_dir / "training_curve.png",
                                 title=f"{cfg.name}: {cfg.model.type} on {self.ds.name}")
        except ImportError:
            pass
        self._report({"finished": True, "metrics": results["test"]})
        return summary


def train(cfg: Config, run_dir: str | Path, *, progress: bool = True, stop_after: int | None = None) -> dict:
    return Trainer(cfg, run_dir, progress=progress, stop_after=stop_after).run()

"""Multi-rank training runs end to end (gloo on CPU): quality parity with one process, the run directory,
exact resume from sharded checkpoints, bad input, and a dead peer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grstack_testing import assert_same_metrics, set_args, tiny_config_args, write_cyclic

from grstack.runtime.cli import main
from grstack.runtime.errors import UserError
from grstack.runtime.model import exported_state
from grstack.runtime.train.launch import ENV_FAULT, free_port, rank_env, train_distributed
from grstack.runtime.train.trainer import train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic", num_users=200)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def _snapshot(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*"))}


def test_two_ranks_reach_the_single_process_quality(tmp_path, data_dir, capsys):
    args = [*tiny_config_args(data_dir), "train.epochs=4"]
    one = train(load_config(CONFIG, args), tmp_path / "one", progress=False)
    run = tmp_path / "two"
    assert main(["train", "--config", str(CONFIG), "--out", str(run), "--nproc", "2", "--no-progress", "--json",
                 *set_args(args)]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two == json.loads((run / "summary.json").read_text())
    assert two["distributed"]["world_size"] == 2 and two["steps"] == one["steps"]
    for k in ("hr@10", "ndcg@10"):
        a, b = one["metrics"]["test"][k], two["metrics"]["test"][k]
        # 200 users: one run's HR@10 has a binomial noise of ~0.03; chance is 10/60
        assert b > 0.5 and b >= a - 0.1, (k, a, b)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert all(r["imbalance"] <= r["imbalance_count_split"] + 1e-9 for r in train_recs)
    assert (run / "model.pt").is_file() and (run / "training_curve.png").is_file()
    # the exported model is an ordinary single-process model: `grstack eval` reproduces the summary
    assert main(["eval", "--run", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["metrics"]
    assert_same_metrics(got, two["metrics"])


def test_resume_is_exact_and_foreign_checkpoints_are_refused(tmp_path, data_dir):
    args = [*tiny_config_args(data_dir), "train.epochs=2", "train.checkpoint_every=4", "pipeline.dbp=true"]
    cfg = load_config(CONFIG, args)
    train_distributed(cfg, tmp_path / "straight", nproc=2, progress=False)
    assert train_distributed(cfg, tmp_path / "resumed", nproc=2, progress=False, stop_after=7) == {
        "stopped_at_step": 7}
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step-000000004", "step-000000007"]
    assert sorted(p.name for p in (tmp_path / "resumed" / "checkpoints" / ckpts[-1]).iterdir()) == [
        "dense.pt", "manifest.json", "rank-00000.pt", "rank-00001.pt"]
    # a checkpoint from another world size or config is refused before anything is written
    before = _snapshot(tmp_path / "resumed")
    with pytest.raises(UserError, match=r"written by 2 rank\(s\).*this job has 1 rank.*--nproc 2"):
        train_distributed(cfg, tmp_path / "resumed", nproc=1, progress=False)
    other = load_config(CONFIG, [*args, "optim.lr=0.02"])
    with pytest.raises(UserError, match=r"another config \(optim.lr differ"):
        train_distributed(other, tmp_path / "resumed", nproc=2, progress=False)
    assert _snapshot(tmp_path / "resumed") == before
    train_distributed(cfg, tmp_path / "resumed", nproc=2, progress=False)
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "resumed")
    a = exported_state(tmp_path / "straight" / "model.pt")
    b = exported_state(tmp_path / "resumed" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


# what a train record holds that does not depend on timing
DETERMINISTIC = ("step", "epoch", "loss", "retrieval_loss", "ranking_loss", "lr", "microbatches",
                 "unique_keys_per_microbatch", "imbalance", "imbalance_count_split", "wait_ratio",
                 "refreshed_rows", "stale_rows")


def _records(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in DETERMINISTIC if k in r} if r["kind"] == "train" else r for r in recs]


def test_resume_is_exact_with_micro_batches_clustering_and_token_budgets(tmp_path, data_dir):
    """Frozen-window micro-batches (3), key clustering, a token budget (variable batch sizes) and logit
    sharing: a run stopped mid-epoch and resumed from its checkpoint repeats the uninterrupted run's
    records (losses, micro-batches, unique keys, imbalance; evaluations) and ends with the same parameters,
    bit for bit."""
    args = [*tiny_config_args(data_dir), "train.epochs=2", "train.checkpoint_every=4", "train.num_threads=1",
            "pipeline.microbatches=3", "pipeline.cluster=true", "balance.token_budget=80", "negatives.share_k=2"]
    cfg = load_config(CONFIG, args)
    straight = train_distributed(cfg, tmp_path / "straight", nproc=2, progress=False)
    assert train_distributed(cfg, tmp_path / "resumed", nproc=2, progress=False, stop_after=10) == {
        "stopped_at_step": 10}
    assert [r["step"] for r in _records(tmp_path / "resumed")] == list(range(1, 11))
    resumed = train_distributed(cfg, tmp_path / "resumed", nproc=2, progress=False)
    recs = _records(tmp_path / "straight")
    train_recs = [r for r in recs if "microbatches" in r]
    # the settings were in force: 3 micro-batches, and batch sizes that vary with the token budget
    assert len(train_recs) == straight["steps"] > 10 and all(r["microbatches"] == 3 for r in train_recs)
    assert len({r["unique_keys_per_microbatch"] for r in train_recs}) > 1
    assert recs == _records(tmp_path / "resumed")
    a = exported_state(tmp_path / "straight" / "model.pt")
    b = exported_state(tmp_path / "resumed" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["metrics"] == resumed["metrics"] and straight["steps"] == resumed["steps"]
    last = sorted((tmp_path / "resumed" / "checkpoints").iterdir())[-1]
    assert last.name == f"step-{straight['steps']:09d}"


MEASURED = ("busy_ms", "busy_ms_max", "sync_wait_ms", "wait_ratio_measured", "imbalance_measured",
            "comm_ms", "exposed_comm_ms", "collective_ms")


def test_two_ranks_log_measured_balance_and_exposed_communication(tmp_path, data_dir):
    """Every train record of a 2-rank run carries the measured figures (every rank's busy time gathered in
    the stats of the dense all-reduce, or of the stats all-reduce inside an accumulation window), with the
    exposed part of the communication events at most their whole; the summary averages them."""
    args = [*tiny_config_args(data_dir), "train.epochs=1", "train.max_steps=6", "train.num_threads=1",
            "train.grad_accum_steps=2", "pipeline.microbatches=2", "pipeline.dbp=true", "eval.max_users=50"]
    summary = train_distributed(load_config(CONFIG, args), tmp_path / "run", nproc=2, progress=False)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["updated"] for r in train_recs] == [False, True] * 3  # both ways of gathering the stats ran
    for r in train_recs:
        assert all(k in r for k in MEASURED), r
        assert 0 < r["busy_ms"] <= r["busy_ms_max"] and r["busy_ms"] <= r["step_ms"]
        assert 0 <= r["wait_ratio_measured"] < 1 and 0 <= r["imbalance_measured"] < 1
        assert 0 <= r["sync_wait_ms"] <= r["exposed_comm_ms"] <= r["comm_ms"] and r["collective_ms"] > 0
    d = summary["distributed"]
    assert 0 <= d["mean_wait_ratio_measured"] < 1 and 0 <= d["mean_imbalance_measured"] < 1
    assert 0 < d["exposed_comm_ratio"] <= 1


def test_unsatisfiable_sharding_plans_are_clear_and_write_nothing(tmp_path, data_dir, capsys):
    out = tmp_path / "run"
    base = ["train", "--config", str(CONFIG), "--out", str(out), "--nproc", "2", "--no-progress",
            *set_args(tiny_config_args(data_dir))]
    assert main([*base, "--set", "distributed.sparse_group_size=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sparse_group_size=3 must divide the number of ranks (2)" in err
    assert main([*base, "--set", "distributed.max_shard_rows=10"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "sharding plan cannot be satisfied" in err and "max_shard_rows=10" in err
    assert not out.exists()


def test_a_dead_peer_makes_every_rank_exit_with_a_clear_message(tmp_path, data_dir):
    """Ranks started as independent processes (as pods are): rank 1 dies after step 3, rank 0 notices on
    its own and exits with status 3 and one line; no summary and no incomplete checkpoint are left."""
    run = tmp_path / "run"
    argv = [sys.executable, "-P", "-m", "grstack.runtime.cli", "train", "--config", str(CONFIG), "--out", str(run),
            "--no-progress", *set_args([*tiny_config_args(data_dir), "train.checkpoint_every=2",
                                        "distributed.timeout_s=20"])]
    port = free_port()
    procs = [subprocess.Popen(argv, env={**os.environ, **rank_env(r, 2, port), ENV_FAULT: "1:3"},
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[1] for p in procs]
    assert procs[1].returncode == 17 and "fault injection" in outs[1]
    assert procs[0].returncode == 3, outs[0]
    last = outs[0].strip().splitlines()[-1]
    assert last.startswith("error: rank 0: lost contact with a peer") and "restarted" in last
    assert not (run / "summary.json").exists()
    names = [p.name for p in (run / "checkpoints").iterdir()]
    assert "step-000000002" in names
    assert all((run / "checkpoints" / n / "manifest.json").is_file() for n in names if not n.startswith("."))
    # restarting the gang resumes from the last complete checkpoint and finishes
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.checkpoint_every=2", "distributed.timeout_s=20"])
    summary = train_distributed(cfg, run, nproc=2, progress=False)
    losses = _losses(run)
    assert summary["steps"] == losses[-1][0] and [s for s, _ in losses] == list(range(1, summary["steps"] + 1))

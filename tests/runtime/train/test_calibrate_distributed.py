"""Calibrated cost weights on 2 ranks (gloo on CPU): every rank gets rank 0's fit and splits alike, and a
calibrated run stopped and resumed repeats the run that splits by the same weights from the start."""

import json
from pathlib import Path

import pytest
import torch
from grstack_dist_workers import DIST_ENV
from grstack_testing import tiny_config_args, write_cyclic

from grstack.runtime.model import exported_state
from grstack.runtime.train.calibrate import PROFILE
from grstack.runtime.train.launch import call_ranks, train_distributed
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
# what a train record holds that does not depend on timing
DETERMINISTIC = ("step", "epoch", "loss", "retrieval_loss", "ranking_loss", "lr", "imbalance",
                 "imbalance_count_split", "wait_ratio")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # lengths from 6 to 120 events: enough spread for the quadratic term to matter
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic", num_users=160, max_len=120)


def _args(data_dir):
    return [*tiny_config_args(data_dir), "data.max_len=100", "train.num_threads=1", "balance.calibrate=true"]


def _records(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in DETERMINISTIC if k in r} if r["kind"] == "train" else r for r in recs]


def test_every_rank_gets_the_same_fit_and_split(data_dir):
    cfg = load_config(CONFIG, _args(data_dir))
    got = call_ranks("grstack_calibrate_workers:calibrate_on_ranks", 2,
                     {"config": cfg.model_dump(mode="json"), "repeats": 2, "steps": 4}, env=DIST_ENV, limit_s=300)
    assert got[0] == got[1]
    fitted = got[0]["fitted"]
    assert fitted["ranks"] == 2 and fitted["repeats"] == 2
    assert fitted["lengths"] == sorted(set(fitted["lengths"])) and len(fitted["lengths"]) >= 5
    assert len(fitted["ms"]) == len(fitted["lengths"]) and min(fitted["ms"]) > 0 and fitted["r2"] <= 1.0
    assert fitted["a"] >= 0 and fitted["b"] >= 0
    assert fitted["clock"] == "thread_cpu" and got[0]["threads"] == 1  # one thread per rank: its CPU time
    assert all(r["rng_kept"] and r["grads_untouched"] for r in got)


def test_a_calibrated_run_resumes_exactly(tmp_path, data_dir):
    args = [*_args(data_dir), "train.epochs=2", "train.checkpoint_every=4"]
    cfg = load_config(CONFIG, args)
    run = tmp_path / "resumed"
    assert train_distributed(cfg, run, nproc=2, progress=False, stop_after=7) == {"stopped_at_step": 7}
    profile = json.loads((run / PROFILE).read_text())
    manifest = json.loads(sorted((run / "checkpoints").iterdir())[-1].joinpath("manifest.json").read_text())
    assert manifest["balance"]["source"] == "calibrated"
    assert {"format": "grstack-balance-profile", **manifest["balance"]["fitted"]} == profile
    written = (run / PROFILE).stat().st_mtime_ns
    # the resumed run splits by its checkpoint's weights: it does not time again (the profile file and the
    # fit are the first part's), whatever balance.calibrate says now
    resumed = train_distributed(load_config(CONFIG, [*args, "balance.calibrate=false"]), run, nproc=2,
                                progress=False)
    assert resumed["balance"] == {"mode": "tokens", **manifest["balance"]}
    assert (run / PROFILE).stat().st_mtime_ns == written
    # a run that splits by the same weights from the start (the profile) repeats it bit for bit
    straight = train_distributed(load_config(CONFIG, [*args, f"balance.profile={run / PROFILE}"]),
                                 tmp_path / "straight", nproc=2, progress=False)
    assert straight["balance"]["source"] == "profile"
    assert (straight["balance"]["cost_a"], straight["balance"]["cost_b"]) == (
        resumed["balance"]["cost_a"], resumed["balance"]["cost_b"])
    assert _records(tmp_path / "straight") == _records(run)
    a = exported_state(tmp_path / "straight" / "model.pt")
    b = exported_state(run / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert straight["metrics"] == resumed["metrics"] and straight["steps"] == resumed["steps"]

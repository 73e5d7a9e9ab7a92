"""Training on 2 ranks that each read only their share of the Parquet data (data.read=shard): each reads
about half of the events, the run learns, a stopped run resumes bit for bit, and changed data or a format
without row groups is a clear error."""

import json
from pathlib import Path

import pytest
from grstack_testing import assert_same_metrics, tiny_config_args

from grstack.runtime.data import LeaveOneOut, read_dataset, write_dataset
from grstack.runtime.data.synth import synthesize
from grstack.runtime.errors import UserError
from grstack.runtime.eval import evaluate_ranking
from grstack.runtime.model import load_exported
from grstack.runtime.train import train
from grstack.runtime.train.launch import train_distributed
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
DETERMINISTIC = ("step", "epoch", "loss", "retrieval_loss", "ranking_loss", "lr", "imbalance",
                 "imbalance_count_split")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_dataset(synthesize("tiny", seed=2), tmp_path_factory.mktemp("d") / "tiny", row_group_size=40)


def _args(data_dir, *extra):
    return [*tiny_config_args(data_dir), "data.read=shard", "data.shuffle_window=2", "train.num_threads=1",
            "train.epochs=2", *extra]


def _records(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in DETERMINISTIC if k in r} if r["kind"] == "train" else r for r in recs]


def test_two_ranks_read_half_the_events_each_and_resume_exactly(tmp_path, data_dir):
    cfg = load_config(CONFIG, _args(data_dir, "train.checkpoint_every=3"))
    straight = train_distributed(cfg, tmp_path / "straight", nproc=2, progress=False)
    data = straight["data"]
    assert data["read"] == "shard" and len(data["events_read_fraction"]) == 2
    assert data["events_read_fraction_max"] <= 0.6 and sum(data["events_read_fraction"]) == pytest.approx(1.0)
    assert data["cache_peak_pieces"] <= 2 * 2 + 2
    assert not (tmp_path / "straight" / "dataset").exists()  # no copy: rank 0 never held the data
    assert json.loads((tmp_path / "straight" / "dataset.json").read_text())["files"]
    assert straight["metrics"]["test"]["hr@10"] > 0 and straight["num_users"] == 400
    assert straight["distributed"]["mean_imbalance"] < straight["distributed"]["mean_imbalance_count_split"]
    # the ranking head, evaluated chunk by chunk on each rank's share, scores the candidate sets one process
    # scores on the whole dataset (sets are seeded by the user's id, not by where the user was read)
    model, mcfg, tasks = load_exported(tmp_path / "straight" / "model.pt")
    split = LeaveOneOut(read_dataset(data_dir), min_len=mcfg.data.min_len)
    whole = {w: {"ranking": evaluate_ranking(model, split, w, tasks, max_len=mcfg.data.max_len,
                                             num_candidates=mcfg.loss.ranking_candidates, seed=mcfg.train.seed)}
             for w in ("valid", "test")}
    assert_same_metrics(whole, {w: {"ranking": straight["metrics"][w]["ranking"]} for w in ("valid", "test")})
    assert len(tasks) == 4 and straight["metrics"]["test"]["ranking"]["next"]["impressions"] == 400 * 4

    run = tmp_path / "resumed"
    assert train_distributed(cfg, run, nproc=2, progress=False, stop_after=5) == {"stopped_at_step": 5}
    resumed = train_distributed(cfg, run, nproc=2, progress=False)
    assert _records(run) == _records(tmp_path / "straight")
    assert resumed["metrics"] == straight["metrics"] and resumed["steps"] == straight["steps"]


def test_a_resumed_run_refuses_data_that_changed(tmp_path):
    d = write_dataset(synthesize("tiny", seed=4), tmp_path / "data", row_group_size=40)
    cfg = load_config(CONFIG, _args(d, "train.checkpoint_every=2"))
    assert train(cfg, tmp_path / "run", progress=False, stop_after=2) == {"stopped_at_step": 2}
    part = sorted(d.glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes() + b"\0")
    with pytest.raises(UserError, match="changed since this run started"):
        train(cfg, tmp_path / "run", progress=False)


def test_sharded_reading_needs_a_parquet_dataset():
    with pytest.raises(UserError, match=r"data\.read=shard reads a Parquet dataset"):
        load_config(CONFIG, ["data.read=shard"])

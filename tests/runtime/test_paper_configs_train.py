"""Each paper config trains and evaluates as shipped (per-token negatives, TF32 switch, its model size), on a
stand-in: the tiny synthetic preset for the fetched data, two small steps, a few evaluated users."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from grstack.runtime.train import train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = ["ml-1m-sasrec", "ml-1m-hstu", "ml-1m-hstu-large", "ml-20m-hstu-large", "books-hstu-large"]
STAND_IN = ["data.format=synth", "data.source=tiny", "train.max_steps=2", "train.batch_size=16",
            "eval.max_users=20", "train.num_threads=1", "train.device=cpu"]


@pytest.mark.parametrize("name", PAPER)
def test_a_paper_config_trains_on_a_stand_in(name: str, tmp_path: Path) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml", STAND_IN)
    assert cfg.loss.sharing == "token" and cfg.train.tf32
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 2 and summary["model"] == cfg.model.type
    assert all(math.isfinite(v) for v in summary["metrics"]["test"].values() if isinstance(v, float))
    assert (tmp_path / "run" / "model.pt").is_file()

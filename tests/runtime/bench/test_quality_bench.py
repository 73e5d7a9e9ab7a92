"""``grstack bench quality``: configs trained side by side, with their ratios and, for ranking heads, the
per-task GAUC difference (the first config minus the second)."""

import json

import pytest

from grstack.runtime.cli import main

pytestmark = pytest.mark.unit

SMALL = ["data.source=tiny", "data.max_len=32", "model.d_model=16", "model.dqk=8", "model.dv=8",
         "loss.negatives=16", "train.epochs=1", "train.eval_every_epochs=1", "eval.max_users=100",
         "train.num_threads=1"]


def test_two_ranking_configs_side_by_side(tmp_path, capsys):
    args = ["bench", "quality", "synthetic-hard-rank-inputs", "synthetic-hard-rank", "--out", str(tmp_path)]
    for o in SMALL:
        args += ["--set", o]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    a, b = out["runs"]
    assert (a["config"], b["config"]) == ("synthetic-hard-rank-inputs", "synthetic-hard-rank")
    ra, rb = a["metrics"]["test"]["ranking"], b["metrics"]["test"]["ranking"]
    assert set(ra) == set(rb) == {"click", "like", "long_view"}
    gaps = out["differences"]["test_ranking_gauc"]
    for task, gap in gaps.items():
        assert gap == pytest.approx(ra[task]["gauc"] - rb[task]["gauc"])
    assert out["ratios"]["test_ndcg@10"] == pytest.approx(
        a["metrics"]["test"]["ndcg@10"] / b["metrics"]["test"]["ndcg@10"])

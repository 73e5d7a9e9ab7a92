"""Where a config's data path is read from: a path in the file from the file's folder (so a config beside its
data works wherever it is run), a path typed with --set from the working directory."""

from pathlib import Path

import pytest

from grstack.runtime.data.source import load_source
from grstack.runtime.errors import UserError
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit


def test_a_path_in_the_file_resolves_against_the_file(tmp_path, monkeypatch):
    cfg_file = tmp_path / "configs" / "c.yaml"
    cfg_file.parent.mkdir()
    cfg_file.write_text("data:\n  format: parquet\n  source: ../data/x\n")
    monkeypatch.chdir(tmp_path / "configs")
    assert Path(load_config(cfg_file, []).data.source) == (tmp_path / "data" / "x").resolve()


def test_a_path_given_with_set_resolves_against_the_working_directory(tmp_path, monkeypatch):
    cfg_file = tmp_path / "configs" / "c.yaml"
    cfg_file.parent.mkdir()
    cfg_file.write_text("data:\n  format: synth\n  source: tiny\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = load_config(cfg_file, ["data.format=parquet", "data.source=data/x"])
    assert Path(cfg.data.source) == (work / "data" / "x").resolve()
    assert load_config(cfg_file, []).data.source == "tiny"  # a synthetic preset is a name, not a path


def _tiny(tmp_path, *overrides: str):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("data:\n  format: synth\n  source: tiny\n")
    return load_config(cfg_file, list(overrides))


@pytest.mark.parametrize(("overrides", "says"), [
    (["loss.ranking_on=exposures", "model.type=sasrec"], "HSTU or FuXi"),
    (["loss.ranking_on=exposures", "loss.ranking_weight=0"], "ranking_weight > 0"),
    (["loss.ranking_on=exposures", "model.ranking_head=false"], "ranking_head=true"),
    (["train.select_metric=ranking.click.ne"], "ranking.TASK.gauc"),
    (["train.select_metric=ranking.click.gauc", "loss.ranking_weight=0"], "trained ranking head"),
    (["train.select_metric=ndcg@7"], "is not one of"),
])
def test_ranking_settings_a_run_cannot_honour_are_refused(tmp_path, overrides, says):
    with pytest.raises(UserError, match=says):
        _tiny(tmp_path, *overrides)


def test_the_ranking_block_is_the_candidate_count_with_exposures_only(tmp_path):
    assert _tiny(tmp_path).ranking_block() == 0
    cfg = _tiny(tmp_path, "loss.ranking_on=exposures", "loss.ranking_candidates=6",
                "train.select_metric=ranking.long_view.auc")
    assert cfg.ranking_block() == 6 and cfg.train.select_metric == "ranking.long_view.auc"


def test_ratings_as_actions_are_read_by_imports_only(tmp_path):
    with pytest.raises(UserError, match=r"rating_actions reads ratings at import .* format synth has none"):
        _tiny(tmp_path, "data.rating_actions=true")
    inter = tmp_path / "r.inter"
    inter.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                     + "".join(f"1\t{i}\t{1 + i % 2}\t{i}\n" for i in range(4)))
    cfg = _tiny(tmp_path, "data.format=recbole", f"data.source={inter}", "data.rating_actions=true")
    ds = load_source(cfg.data)
    assert ds.action_names == ["rating_1", "rating_2"] and ds.actions.tolist() == [1, 2, 1, 2]
    assert load_source(_tiny(tmp_path, "data.format=recbole", f"data.source={inter}").data).actions is None

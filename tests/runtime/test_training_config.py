"""Where a config's data path is read from: a path in the file from the file's folder (so the shipped
configs find ../shared/data wherever they are run), a path typed with --set from the working directory."""

from pathlib import Path

import pytest

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

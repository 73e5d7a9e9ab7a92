"""The main job runs end to end on the embedded default: no data, no services."""

import json

import pytest

from grstack.runtime.cli import main


@pytest.mark.e2e
def test_demo_quick_trains_evaluates_and_reports(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "popularity baseline" in printed and str(out) in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"].startswith("synthetic") and summary["steps"] > 0
    assert (out / "baseline_popularity.json").is_file()


@pytest.mark.unit
def test_demo_refuses_a_foreign_non_empty_directory(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("mine")
    assert main(["demo", "--out", str(tmp_path / "x")]) == 2
    assert "not empty" in capsys.readouterr().err

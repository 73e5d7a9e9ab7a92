"""The main job runs end to end on the embedded default: no data, no services."""

import json

import pytest

from grstack.runtime.cli import main


@pytest.mark.e2e
def test_demo_quick_trains_a_head_above_chance_reports_each_phase_and_what_figures_mean(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the default run directory, runs/demo-quick
    assert main(["demo", "--quick", "--set", "train.num_threads=1"]) == 0
    printed, progress = capfd.readouterr()
    out = tmp_path / "runs" / "demo-quick"
    assert "popularity baseline" in printed and "runs/demo-quick" in printed
    assert "(chance 0.50)" in printed and "candidates for" in printed and "(chance 5%)" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"].startswith("synthetic") and summary["steps"] > 0
    assert summary["metrics"]["test"]["ranking"]["next"]["auc"] > 0.55  # beats chance (0.5), not only by noise
    assert (out / "baseline_popularity.json").is_file() and (out / "training_curve.png").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "train" for r in records) >= 20 and sum(r["kind"] == "eval" for r in records) >= 3
    for phase in ("demo: data: generating", "demo: training:", "evaluation: the best model",
                  "demo: serving: starting", "demo: serving: ready", "demo: load: done"):
        assert phase in progress, phase
    report = json.loads((out / "serve_report.json").read_text())
    assert report["ok"] == report["requests"] > 0


@pytest.mark.unit
def test_demo_refuses_a_foreign_non_empty_directory(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("mine")
    assert main(["demo", "--out", str(tmp_path / "x")]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.unit
def test_demo_and_quick_demo_default_to_run_directories_of_their_own(tmp_path, monkeypatch, capsys):
    """`make demo` after `grstack demo --quick` must not meet the quick run's directory."""
    monkeypatch.chdir(tmp_path)
    for name in ("demo", "demo-quick"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "file").write_text("mine")
    assert main(["demo", "--quick"]) == 2
    assert "runs/demo-quick exists and is not empty" in capsys.readouterr().err
    assert main(["demo"]) == 2
    assert "runs/demo exists and is not empty" in capsys.readouterr().err


@pytest.mark.unit
def test_demo_refuses_to_resume_the_other_demos_run_in_one_line(tmp_path, capsys):
    from grstack.runtime.config_files import config_path
    from grstack.runtime.demo import DEMO_CONFIG, DEMO_OVERRIDES, QUICK_OVERRIDES
    from grstack.runtime.training_config import dump_config, load_config

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)  # what an interrupted quick demo leaves
    quick = load_config(config_path(DEMO_CONFIG), [*DEMO_OVERRIDES, *QUICK_OVERRIDES, "pipeline.dbp=true"])
    (out / "config.yaml").write_text(dump_config(quick))
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another demo configuration (data.source differ" in err[0]


@pytest.mark.unit
def test_demo_refuses_a_finished_run_in_one_line(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert main(["demo", "--quick", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a finished demo run" in err[0]

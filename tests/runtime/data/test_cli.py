"""``grstack data ...`` through the real entry point: summaries, stats, and every bad input -> exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grstack.runtime.cli import main
from grstack.runtime.data import cli as data_cli
from grstack.runtime.data.dataset import read_dataset
from grstack.runtime.data.importers import IMPORTERS
from grstack.runtime.data.synth import PRESETS

from .conftest import RECBOLE_HEADER

pytestmark = pytest.mark.unit


def test_choices_match_the_implementations() -> None:
    assert sorted(data_cli.FORMATS) == sorted(IMPORTERS)
    assert sorted(data_cli.PRESETS) == sorted(PRESETS)


@pytest.mark.parametrize("argv", [["data"], ["data", "import"], ["data", "synth"], ["data", "stats"]])
def test_help(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    assert "usage: grstack data" in capsys.readouterr().out


def test_import_then_stats(recbole_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "ds"
    assert main(["data", "import", "--format", "recbole", str(recbole_file), "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("imported toy: 2 users, 4 items, 7 events -> ") and "\n" not in line
    assert read_dataset(out).num_events == 7
    assert main(["data", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2 users, 4 items (4 seen), 7 events" in text and "kept users with >= 3 events" in text


def test_min_len_flag_and_dropped_summary(write, tmp_path: Path, capsys) -> None:
    src = write("s.txt", "1 5 6 7\n2 5 6\n")
    assert main(["data", "import", "--format", "seqtxt", str(src), "--out", str(tmp_path / "a")]) == 0
    assert "dropped 1 users with < 3 events" in capsys.readouterr().out
    assert main(["data", "import", "--format", "seqtxt", str(src), "--out", str(tmp_path / "b"),
                 "--min-len", "2"]) == 0
    assert read_dataset(tmp_path / "b").num_users == 2


def test_synth_then_stats_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "syn"
    assert main(["data", "synth", "--preset", "tiny", "--seed", "5", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("generated synthetic-tiny: 400 users, 800 items")
    assert main(["data", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["users"] == 400 and stats["source"] == "synth:tiny:seed=5"
    assert set(stats["length"]) == {"min", "mean", "p50", "p90", "p99", "max"}
    assert set(stats["actions"]) == {"click", "like", "long_view"}


BAD = {
    "malformed line": ("recbole", "bad.inter", RECBOLE_HEADER + "1\t2\t3\t4\n1\t2\t3\t4\n1\t2\t3\n",
                       "bad.inter, line 4: expected 4 tab-separated fields, got 3"),
    "non-integer id": ("movielens", "u.data", "1\t2\t5\t9\n7\tx9\t5\t9\n",
                       "u.data, line 2: item_id must be an integer"),
    "non-integer id (seqtxt)": ("seqtxt", "b.txt", "1 2 3\n2 3 4\n3 a1 5\n",
                                "b.txt, line 3: ids must be integers"),
    "empty file": ("seqtxt", "e.txt", "", "e.txt: empty file"),
    "empty kuairand log": ("kuairand", "log_standard_e.csv", "", "log_standard_e.csv: empty file"),
    "unknown format": ("parquet", "b.txt", "1 2 3\n", "unknown format 'parquet'"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_exits_2_with_one_line_and_no_output(case: str, write, tmp_path: Path, capsys) -> None:
    fmt, name, text, message = BAD[case]
    src = write(f"src/{name}", text)
    out = tmp_path / "out" / "ds"
    assert main(["data", "import", "--format", fmt, str(src), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert not out.exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_missing_source_and_non_empty_out(tmp_path: Path, write, capsys) -> None:
    missing = tmp_path / "nowhere" / "ratings.dat"
    assert main(["data", "import", "--format", "movielens", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: argument src: {missing} does not exist\n"
    assert not (tmp_path / "o").exists()

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    src = write("ok.txt", "1 2 3 4\n")
    for argv in (["import", "--format", "seqtxt", str(src)], ["synth", "--preset", "tiny"]):
        assert main(["data", *argv, "--out", str(full)]) == 2
        assert capsys.readouterr().err == f"error: output directory {full} exists and is not empty\n"
    assert [p.name for p in full.iterdir()] == ["keep.txt"]


def test_bad_preset_and_stats_of_a_non_dataset(tmp_path: Path, capsys) -> None:
    assert main(["data", "synth", "--preset", "huge", "--out", str(tmp_path / "o")]) == 2
    assert "unknown synth preset 'huge'" in capsys.readouterr().err
    assert main(["data", "stats", str(tmp_path)]) == 2
    assert "is not a grstack dataset: meta.json is missing" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_clicks_only_is_for_kuairand(write, tmp_path: Path, capsys) -> None:
    src = write("s.txt", "1 2 3 4\n")
    argv = ["data", "import", "--format", "seqtxt", str(src), "--out", str(tmp_path / "o"), "--clicks-only"]
    assert main(argv) == 2
    assert "--clicks-only applies to --format kuairand only" in capsys.readouterr().err


def test_rating_actions_flag(recbole_file: Path, write, tmp_path: Path, capsys) -> None:
    out = tmp_path / "r"
    assert main(["data", "import", "--format", "recbole", str(recbole_file), "--out", str(out),
                 "--rating-actions"]) == 0
    ds = read_dataset(out)
    assert ds.action_names == ["rating_4"] and ds.actions.tolist() == [1] * 7  # every toy rating is 4
    src = write("s.txt", "1 2 3 4\n")
    assert main(["data", "import", "--format", "seqtxt", str(src), "--out", str(tmp_path / "o"),
                 "--rating-actions"]) == 2
    assert "--rating-actions applies to --format recbole or movielens" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

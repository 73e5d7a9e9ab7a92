"""Timestamp units: every importer stores Unix seconds, refuses a bad time by its line, detects the unit
or refuses to guess, and ``data stats`` reads whatever was stored without crashing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.cli import main
from grstack.runtime.data import cli as data_cli
from grstack.runtime.data.dataset import from_sequences, read_dataset, write_dataset
from grstack.runtime.data.importers import import_dataset, kuairand
from grstack.runtime.data.importers.common import RowLines, to_seconds
from grstack.runtime.data.importers.timestamps import UNITS, detect, iso
from grstack.runtime.data.stats import dataset_stats, format_stats
from grstack.runtime.errors import UserError

from .conftest import KUAIRAND_HEADER, RECBOLE_HEADER, kuairand_row

pytestmark = pytest.mark.unit

T0 = 1_649_376_000  # 2022-04-08T00:00:00Z


def inter(write, name: str, times: list[str]) -> Path:
    """A RecBole file: user 1 rates items 10, 11, ... at ``times`` (one line each, from line 2)."""
    return write(name, RECBOLE_HEADER + "".join(f"1\t{10 + k}\t4\t{t}\n" for k, t in enumerate(times)))


def test_cli_choices_match_the_units() -> None:
    assert data_cli.TIMESTAMP_UNITS == UNITS


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1e308", "line 3: timestamp 1e+308 read as seconds is not before 2100-01-01"),
        ("1e300", "line 3: timestamp 1e+300 read as seconds is not before 2100-01-01"),
        ("-1e30", "line 3: timestamp -1e+30 is negative"),
        ("-1", "line 3: timestamp -1 is negative"),
        ("nan", "line 3: timestamp must be a finite number, got 'nan'"),
        ("inf", "line 3: timestamp must be a finite number"),
        ("4102444800", "line 3: timestamp 4102444800 read as seconds is 2100-01-01T00:00:00Z, not before 2100"),
    ],
)
def test_recbole_out_of_range_time_is_refused_by_its_line(write, value: str, message: str) -> None:
    path = inter(write, "a.inter", [str(T0), value, str(T0 + 5)])
    with pytest.raises(UserError) as err:
        import_dataset("recbole", path)
    assert str(err.value).startswith(f"{path}, {message}")
    assert "\n" not in str(err.value)


def test_auto_detects_seconds_milliseconds_and_microseconds(write) -> None:
    want = [T0 + 1, T0 + 2, T0 + 3]
    for unit, f in (("s", 1), ("ms", 1000), ("us", 1_000_000)):
        path = inter(write, f"{unit}/x.inter", [str((T0 + k) * f + f // 2) for k in (3, 1, 2)])
        ds = import_dataset("recbole", path)
        assert ds.timestamps.tolist() == want, unit
        assert ds.sequence(0).tolist() == [2, 3, 1]  # ordered by time, whatever the unit
        assert ds.info["timestamp_unit"] == unit


def test_small_ordinal_times_are_seconds(write) -> None:
    ds = import_dataset("recbole", inter(write, "o.inter", ["0", "1", "2"]))
    assert ds.timestamps.tolist() == [0, 1, 2] and ds.info["timestamp_unit"] == "s"


@pytest.mark.parametrize("median", ["16493760000", "1649376000000000000", "5000000000000"])
def test_auto_refuses_values_no_unit_fits(write, median: str) -> None:
    path = inter(write, "amb.inter", [median, median, median])
    with pytest.raises(UserError, match=r"amb.inter: cannot tell the unit of timestamp from its values "
                                        r".*pass --timestamp-unit s, ms or us \(in a training config: "
                                        r"data.timestamp_unit\)$"):
        import_dataset("recbole", path)


def test_auto_refuses_a_file_that_mixes_units(write) -> None:
    path = inter(write, "mix.inter", [str(T0 * 1000), str(T0), str(T0 * 1000 + 5)])
    with pytest.raises(UserError, match=r"mix.inter, line 3: timestamp 1649376000 read as milliseconds is "
                                        r"1970-01-20.*does it mix units\?"):
        import_dataset("recbole", path)
    # A file of seconds with one row in milliseconds: that row is after 2100 as seconds.
    path = inter(write, "mix2.inter", [str(T0), str(T0 + 1), str(T0 * 1000)])
    with pytest.raises(UserError, match=r"mix2.inter, line 4: timestamp 1649376000000 read as seconds is not "
                                        r"before 2100-01-01; seconds were detected from the file's values"):
        import_dataset("recbole", path)


def test_explicit_unit_overrides_detection(write) -> None:
    path = inter(write, "x.inter", ["1000", "2500", "3999"])
    assert import_dataset("recbole", path).timestamps.tolist() == [1000, 2500, 3999]
    assert import_dataset("recbole", path, timestamp_unit="ms").timestamps.tolist() == [1, 2, 3]
    assert import_dataset("recbole", path, timestamp_unit="us").timestamps.tolist() == [0, 0, 0]
    ms = inter(write, "ms.inter", [str(T0 * 1000), str(T0 * 1000 + 1)])
    with pytest.raises(UserError, match=r"line 2: timestamp 1649376000000 read as seconds is not before 2100"):
        import_dataset("recbole", ms, timestamp_unit="s")
    with pytest.raises(UserError, match="unknown timestamp unit 'ns'"):
        import_dataset("recbole", ms, timestamp_unit="ns")


def test_float_milliseconds_floor_exactly(write) -> None:
    # 1649376001000 * 0.001 is 1649376000.9999998 in floating point; dividing by 1000 is exact.
    path = inter(write, "f.inter", ["1649376001000", "1649376001999.5", "1649376002000"])
    assert import_dataset("recbole", path).timestamps.tolist() == [T0 + 1, T0 + 1, T0 + 2]


def test_formats_without_times_refuse_an_explicit_unit(write) -> None:
    with pytest.raises(UserError, match="seqtxt files have no timestamps"):
        import_dataset("seqtxt", write("s.txt", "1 2 3 4\n"), timestamp_unit="ms")
    assert import_dataset("seqtxt", write("t.txt", "1 2 3 4\n")).timestamps.tolist() == [0, 1, 2]
    no_time = write("n.inter", "user_id:token\titem_id:token\n1\t2\n1\t3\n1\t4\n")
    with pytest.raises(UserError, match=r"n.inter, line 1: --timestamp-unit ms: the header has no 'timestamp'"):
        import_dataset("recbole", no_time, timestamp_unit="ms")


def test_movielens_times(write) -> None:
    path = write("a/u.data", f"1\t2\t5\t{T0}\n1\t3\t5\t-7\n")
    with pytest.raises(UserError, match=r"u.data, line 2: timestamp -7 is negative"):
        import_dataset("movielens", path)
    path = write("b/ratings.dat", f"1::2::5::{T0}\n1::3::5::{2**62}\n1::4::5::{T0}\n")
    with pytest.raises(UserError, match=r"ratings.dat, line 2: timestamp 4611686018427387904 read as seconds"):
        import_dataset("movielens", path)
    path = write("c/ratings.csv", f"userId,movieId,rating,timestamp\n1,2,5,{T0}\n1,3,5,99999999999999999999\n")
    with pytest.raises(UserError, match=r"ratings.csv, line 3: timestamp 99999999999999999999 does not fit in "
                                        r"64 bits"):
        import_dataset("movielens", path)
    ms = write("d/u.data", "".join(f"1\t{i}\t5\t{(T0 + i) * 1000}\n" for i in range(3)))
    ds = import_dataset("movielens", ms, min_len=1)
    assert ds.timestamps.tolist() == [T0, T0 + 1, T0 + 2] and ds.info["timestamp_unit"] == "ms"


def test_kuairand_reads_milliseconds_and_refuses_bad_times(write) -> None:
    rows = kuairand_row(1, 5, T0 * 1000 + 999) + kuairand_row(1, 6, T0 * 1000) + kuairand_row(1, 7, 4)
    ds = import_dataset("kuairand", write("a/log_standard_a.csv", KUAIRAND_HEADER + rows))
    assert ds.timestamps.tolist() == [0, T0, T0] and ds.info["timestamp_unit"] == "ms"
    assert ds.sequence(0).tolist() == [3, 2, 1]  # items 7, 6, 5
    us = import_dataset("kuairand", write("b/log_standard_b.csv", KUAIRAND_HEADER + rows), timestamp_unit="us")
    assert us.timestamps.tolist() == [0, T0 // 1000, T0 // 1000]
    bad = KUAIRAND_HEADER + kuairand_row(1, 5, 10) + kuairand_row(1, 6, -10)
    with pytest.raises(UserError, match=r"log_standard_c.csv, line 3: time_ms -10 is negative"):
        import_dataset("kuairand", write("c/log_standard_c.csv", bad))
    late = KUAIRAND_HEADER + kuairand_row(1, 5, 10) + kuairand_row(1, 6, 4_102_444_800_000)
    with pytest.raises(UserError, match=r"log_standard_d.csv, line 3: time_ms 4102444800000 read as "
                                        r"milliseconds is 2100-01-01T00:00:00Z"):
        import_dataset("kuairand", write("d/log_standard_d.csv", late))


def test_kuairand_bad_time_after_the_first_batch_names_its_line(write, monkeypatch) -> None:
    """Rows are checked batch by batch; the line number counts every earlier batch."""
    monkeypatch.setattr(kuairand, "BLOCK_SIZE", 1 << 10)  # a few rows per batch instead of 64 MiB
    n = 500
    rows = "".join(kuairand_row(u % 50, u, 1000 + u) for u in range(n))
    path = write("log_standard_big.csv", KUAIRAND_HEADER + rows + "\n" + kuairand_row(1, 2, -5))
    with pytest.raises(UserError, match=rf"line {n + 3}: time_ms -5 is negative"):
        import_dataset("kuairand", path)


def test_row_lines_maps_rows_to_lines_skipping_blank_ones(write) -> None:
    path = write("r.txt", "header\n\na\n\nb\nc\n")
    rows = RowLines(path, skip=1)
    assert [rows.line(i) for i in range(3)] == [3, 5, 6]
    assert RowLines(path, skip=1, first_row=2).line(0) == 6
    with pytest.raises(UserError, match=r"r.txt, line 5: timestamp -1 is negative"):
        to_seconds(np.array([5, -1, 7]), "s", rows)
    assert to_seconds(np.array([1500, 2500]), "ms", rows).tolist() == [1, 2]


def test_detection_windows_do_not_overlap() -> None:
    assert detect(0) == detect(4_102_444_799) == "s"
    assert detect(4_102_444_800) is None and detect(99_999_999_999) is None
    assert detect(1e11) == detect(4_102_444_799_999) == "ms"
    assert detect(4_102_444_800_000) is None and detect(1e14 - 1) is None
    assert detect(1e14) == "us" and detect(4_102_444_800_000_000) is None
    assert iso(0) == "1970-01-01T00:00:00Z" and iso(1e300) is None and iso(float("nan")) is None


def test_stats_of_a_millisecond_import(write, tmp_path: Path, capsys) -> None:
    src = inter(write, "src/ms.inter", [str(T0 * 1000 + k * 86_400_000) for k in range(4)])
    out = tmp_path / "ds"
    assert main(["data", "import", "--format", "recbole", str(src), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["data", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["time"]["first_iso"] == "2022-04-08T00:00:00Z"
    assert stats["time"]["last_iso"] == "2022-04-11T00:00:00Z" and stats["time"]["span_days"] == 3.0
    assert read_dataset(out).info["timestamp_unit"] == "ms"


@pytest.mark.parametrize("stamp", [1_649_376_000_000, 55_840 * 31_557_600, 2**62, 2**63 - 1])
def test_stats_never_crash_on_stored_times(stamp: int, tmp_path: Path, capsys) -> None:
    """A dataset written before importers checked units (milliseconds stored as seconds) still has stats."""
    ds = from_sequences([1], [np.array([1, 2])], [np.array([0, stamp])], num_items=2, name="old")
    text = format_stats(dataset_stats(ds))
    assert "outside years 1-9999" in text
    write_dataset(ds, tmp_path / "old")
    assert main(["data", "stats", str(tmp_path / "old")]) == 0
    assert "1970-01-01T00:00:00Z" in capsys.readouterr().out


def test_cli_timestamp_unit(write, tmp_path: Path, capsys) -> None:
    src = inter(write, "src/x.inter", ["1000", "2000", "3000"])
    assert main(["data", "import", "--format", "recbole", str(src), "--out", str(tmp_path / "a"),
                 "--timestamp-unit", "ms"]) == 0
    assert read_dataset(tmp_path / "a").timestamps.tolist() == [1, 2, 3]
    capsys.readouterr()
    bad = inter(write, "src2/b.inter", ["1000", "1e308", "3000"])
    out = tmp_path / "b"
    assert main(["data", "import", "--format", "recbole", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}, line 3: timestamp 1e+308") and err.count("\n") == 1
    assert not out.exists()
    assert main(["data", "import", "--format", "recbole", str(src), "--out", str(tmp_path / "c"),
                 "--timestamp-unit", "ns"]) == 2
    assert "--timestamp-unit: invalid choice: 'ns'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    seq = write("s.txt", "1 2 3 4\n")
    assert main(["data", "import", "--format", "seqtxt", str(seq), "--out", str(tmp_path / "d"),
                 "--timestamp-unit", "s"]) == 2
    assert "seqtxt files have no timestamps" in capsys.readouterr().err


def test_config_timestamp_unit(write) -> None:
    from grstack.runtime.data.source import load_source
    from grstack.runtime.training_config import DataConfig

    src = inter(write, "cfg/x.inter", ["1000", "2000", "3000"])
    assert load_source(DataConfig(format="recbole", source=str(src))).timestamps.tolist() == [1000, 2000, 3000]
    ds = load_source(DataConfig(format="recbole", source=str(src), timestamp_unit="ms"))
    assert ds.timestamps.tolist() == [1, 2, 3]
    with pytest.raises(UserError, match=r"data\.timestamp_unit ms applies to imports; format synth"):
        load_source(DataConfig(format="synth", source="tiny", timestamp_unit="ms"))

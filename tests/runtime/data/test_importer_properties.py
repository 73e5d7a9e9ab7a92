"""Property tests over each importer's line grammar (hypothesis).

Valid files import, and what is stored is exactly the file: per user the items in time order (ties in file
order), timestamps floored to seconds, the same after a write/read round trip. A file with one bad line is
refused with a UserError naming that line, never another exception, and the CLI writes nothing for it.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grstack.runtime.cli import main
from grstack.runtime.data.dataset import SequenceDataset, read_dataset, write_dataset
from grstack.runtime.data.importers import import_dataset
from grstack.runtime.data.importers.timestamps import MAX_SECONDS, PER_SECOND
from grstack.runtime.errors import UserError

from .conftest import KUAIRAND_HEADER, RECBOLE_HEADER

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TOKENS = st.text(alphabet="abcXYZ_0123456789", min_size=1, max_size=24)
UNITS = st.sampled_from(list(PER_SECOND))

Event = tuple[str, str, float | int]  # (user token, item token, raw time) as written in the file


def times(unit: str, integral: bool = True) -> st.SearchStrategy:
    top = MAX_SECONDS * PER_SECOND[unit] - 1
    if integral:
        return st.integers(min_value=0, max_value=top)
    return st.one_of(st.integers(min_value=0, max_value=top),
                     st.floats(min_value=0, max_value=float(top), allow_nan=False, allow_infinity=False))


def expected(events: list[Event], per_second: int) -> dict[str, list[tuple[str, int]]]:
    """user -> [(item, stored seconds)] in time order, ties in file order (Python's sort is stable)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for user in dict.fromkeys(e[0] for e in events):
        mine = sorted((e for e in events if e[0] == user), key=lambda e: e[2])
        out[user] = [(item, int(np.floor(t / per_second)) if isinstance(t, float) else t // per_second)
                     for _, item, t in mine]
    return out


def stored(ds: SequenceDataset) -> dict[str, list[tuple[str, int]]]:
    users = ds.user_raw_ids if ds.user_raw_ids is not None else ds.user_ids
    out = {}
    for k in range(ds.num_users):
        lo, hi = ds.offsets[k], ds.offsets[k + 1]
        items = [str(ds.item_raw_ids[i - 1]) for i in ds.item_ids[lo:hi]]
        out[str(users[k])] = list(zip(items, ds.timestamps[lo:hi].tolist(), strict=True))
    return out


def same_after_round_trip(ds: SequenceDataset) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        back = read_dataset(write_dataset(ds, Path(tmp) / "ds"))
    for f in ("user_ids", "offsets", "item_ids", "timestamps", "item_raw_ids", "user_raw_ids"):
        a, b = getattr(ds, f), getattr(back, f)
        assert (a is None and b is None) or np.array_equal(a, b), f


def refused_at(write_file: Callable[[Path], Path], fmt: str, lineno: int | None, **opts: object) -> str:
    """Imports the file ``write_file`` writes; asserts a one-line UserError naming ``lineno`` (when given),
    then runs the same through the CLI and asserts exit 2, one stderr line and no output directory."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write_file(Path(tmp))
        with pytest.raises(UserError) as err:
            import_dataset(fmt, path, min_len=1, **opts)
        message = str(err.value)
        assert message.startswith(f"{path}"), message
        assert "\n" not in message
        if lineno is not None:
            assert message.startswith(f"{path}, line {lineno}: "), message
        out = Path(tmp) / "out"
        argv = ["data", "import", "--format", fmt, str(path), "--out", str(out), "--min-len", "1"]
        if "timestamp_unit" in opts:
            argv += ["--timestamp-unit", str(opts["timestamp_unit"])]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 2
        assert stderr.getvalue() == f"error: {message}\n"
        assert not out.exists()
    return message


def imported(write_file: Callable[[Path], Path], fmt: str, **opts: object) -> SequenceDataset:
    with tempfile.TemporaryDirectory() as tmp:
        return import_dataset(fmt, write_file(Path(tmp)), min_len=1, **opts)


# -- RecBole ---------------------------------------------------------------------------------------------------
def recbole_events(unit: str) -> st.SearchStrategy[list[Event]]:
    return st.lists(st.tuples(TOKENS, TOKENS, times(unit, integral=False)), min_size=1, max_size=30)


def recbole_text(events: list[Event]) -> str:
    return RECBOLE_HEADER + "".join(f"{u}\t{i}\t4\t{t!r}\n" for u, i, t in events)


@SETTINGS
@given(data=st.data(), unit=UNITS)
def test_recbole_valid_files_round_trip(data: st.DataObject, unit: str) -> None:
    events = data.draw(recbole_events(unit))
    ds = imported(lambda d: _put(d / "x.inter", recbole_text(events)), "recbole", timestamp_unit=unit)
    assert stored(ds) == expected(events, PER_SECOND[unit])
    same_after_round_trip(ds)


BAD_TIMES = ["nan", "NaN", "NA", "null", "inf", "-inf", "-1", "-1e30", "1e308", "1e300", "1e400", "soon", "",
             "1_000", "0x10"]


@SETTINGS
@given(data=st.data(), unit=UNITS)
def test_recbole_a_bad_line_is_refused_by_number(data: st.DataObject, unit: str) -> None:
    events = data.draw(recbole_events(unit))
    lines = recbole_text(events).splitlines(keepends=True)
    k = data.draw(st.integers(min_value=1, max_value=len(lines) - 1))
    user, item, _ = events[k - 1]
    bad = data.draw(st.sampled_from([
        *(f"{user}\t{item}\t4\t{t}\n" for t in BAD_TIMES),
        f"{user}\t{item}\t4\t{MAX_SECONDS * PER_SECOND[unit]}\n",
        f"{user}\t{item}\t4\n",
        f"{user}\t{item}\t4\t1\t1\n",
        f"\t{item}\t4\t1\n",
        f"{user}\t\t4\t1\n",
    ]))
    lines[k] = bad
    text = "".join(lines)
    if data.draw(st.booleans()):
        text = text.replace("\n", "\r\n")
    refused_at(lambda d: _put(d / "x.inter", text), "recbole", k + 1, timestamp_unit=unit)


@SETTINGS
@given(data=st.data())
def test_recbole_auto_reads_each_unit_it_detects(data: st.DataObject) -> None:
    unit = data.draw(UNITS)
    f = PER_SECOND[unit]
    low = 0 if unit == "s" else 100_000_000 * f
    events = data.draw(st.lists(st.tuples(TOKENS, TOKENS, st.integers(low, MAX_SECONDS * f - 1)),
                                min_size=1, max_size=20))
    ds = imported(lambda d: _put(d / "x.inter", recbole_text(events)), "recbole")
    assert ds.info["timestamp_unit"] == unit
    assert stored(ds) == expected(events, f)


# -- seqtxt ----------------------------------------------------------------------------------------------------
SEQ_ROWS = st.lists(st.tuples(INT64, st.lists(INT64, min_size=1, max_size=6)), min_size=1, max_size=15,
                    unique_by=lambda r: r[0])
SPACE = st.sampled_from([" ", "\t", "  ", " \t "])


def seqtxt_text(data: st.DataObject, rows: list[tuple[int, list[int]]]) -> tuple[str, list[int]]:
    """The file, and the line number of each row (blank lines are drawn in between)."""
    lines, numbers = [], []
    for user, items in rows:
        while data.draw(st.booleans()) and data.draw(st.booleans()):
            lines.append("")
        numbers.append(len(lines) + 1)
        sep = data.draw(SPACE)
        lines.append(sep.join(str(t) for t in [user, *items]) + data.draw(st.sampled_from(["", " "])))
    return "\n".join(lines) + "\n", numbers


@SETTINGS
@given(data=st.data(), rows=SEQ_ROWS)
def test_seqtxt_valid_files_round_trip(data: st.DataObject, rows: list[tuple[int, list[int]]]) -> None:
    text, _ = seqtxt_text(data, rows)
    ds = imported(lambda d: _put(d / "s.txt", text), "seqtxt")
    assert stored(ds) == {str(u): [(str(i), t) for t, i in enumerate(items)] for u, items in sorted(rows)}
    same_after_round_trip(ds)


@SETTINGS
@given(data=st.data(), rows=SEQ_ROWS)
def test_seqtxt_a_bad_line_is_refused_by_number(data: st.DataObject, rows: list[tuple[int, list[int]]]) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(rows) - 1))
    user, items = rows[k]
    kind = data.draw(st.sampled_from(["token", "wide", "duplicate"]))
    if kind == "token":
        items = [*items, data.draw(st.sampled_from(["5.0", "a1", "1-2", "--3", "7-", "x"]))]
    elif kind == "wide":
        items = [*items, data.draw(st.sampled_from([10**23, -(10**23), 2**63, -(2**63) - 1]))]
    elif k > 0:
        user = rows[0][0]
    else:
        rows = [*rows, (user, items)]
        k = len(rows) - 1
    rows = [*rows[:k], (user, items), *rows[k + 1:]]
    text, numbers = seqtxt_text(data, rows)
    message = refused_at(lambda d: _put(d / "s.txt", text), "seqtxt", numbers[k])
    if kind == "duplicate":
        assert "already appeared on line" in message


# -- MovieLens -------------------------------------------------------------------------------------------------
LAYOUTS = {"u.data": ("\t", ""), "ratings.dat": ("::", ""), "ratings.csv": (",", "userId,movieId,rating,timestamp\n")}
ML_ROWS = st.lists(st.tuples(INT64, INT64, st.sampled_from(["1", "2.5", "5", "4.0"]), times("s")),
                   min_size=1, max_size=25)


def movielens_text(layout: str, rows: list[tuple[int, int, str, int]]) -> str:
    sep, header = LAYOUTS[layout]
    return header + "".join(sep.join(map(str, r)) + "\n" for r in rows)


@SETTINGS
@given(layout=st.sampled_from(list(LAYOUTS)), rows=ML_ROWS, crlf=st.booleans())
def test_movielens_valid_files_round_trip(layout: str, rows: list[tuple[int, int, str, int]], crlf: bool) -> None:
    text = movielens_text(layout, rows)
    ds = imported(lambda d: _put(d / layout, text.replace("\n", "\r\n") if crlf else text), "movielens")
    assert stored(ds) == expected([(str(u), str(i), t) for u, i, _, t in rows], 1)
    same_after_round_trip(ds)


@SETTINGS
@given(data=st.data(), layout=st.sampled_from(list(LAYOUTS)), rows=ML_ROWS)
def test_movielens_a_bad_line_is_refused_by_number(data: st.DataObject, layout: str,
                                                   rows: list[tuple[int, int, str, int]]) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(rows) - 1))
    u, i, r, t = rows[k]
    bad = data.draw(st.sampled_from([
        (u, i, r, "4.5"), (u, i, r, "-1"), (u, i, r, str(MAX_SECONDS)), (u, i, r, str(2**63)), (u, i, r, ""),
        (u, i, r, "NaN"), (u, i, r, "1e3"), ("", i, r, t), ("null", i, r, t), (u, "NA", r, t),
        (u, "two", r, t), (2**64, i, r, t), (u, i, "x", t), (u, i, "nan", t), (u, i, "1_0", t), (u, i, r),
        (u, i, r, t, t),
    ]))
    text = movielens_text(layout, [*rows[:k], bad, *rows[k + 1:]])
    header = 1 if LAYOUTS[layout][1] else 0
    refused_at(lambda d: _put(d / layout, text), "movielens", k + 1 + header, timestamp_unit="s")


# -- KuaiRand --------------------------------------------------------------------------------------------------
COLUMNS = KUAIRAND_HEADER.strip().split(",")
KR_ROWS = st.lists(st.tuples(INT64, INT64, times("ms"), st.integers(0, 1), st.integers(0, 1)),
                   min_size=1, max_size=25)


def kuairand_line(data: st.DataObject, user: object, video: object, time_ms: object, click: object,
                  like: object) -> str:
    values = {"user_id": user, "video_id": video, "time_ms": time_ms, "is_click": click, "is_like": like,
              "date": 20220408, "tab": "1"}
    cells = [str(values.get(c, 0)) for c in COLUMNS]
    if data.draw(st.booleans()):  # quote every cell, or a few: the csv grammar allows both
        cells = [f'"{c}"' if not c.startswith('"') and data.draw(st.booleans()) else c for c in cells]
    return ",".join(cells) + "\n"


def kuairand_text(data: st.DataObject, rows: list[tuple]) -> str:
    header = ",".join(f'"{c}"' for c in COLUMNS) + "\n" if data.draw(st.booleans()) else KUAIRAND_HEADER
    return header + "".join(kuairand_line(data, *r) for r in rows)


@SETTINGS
@given(data=st.data(), rows=KR_ROWS)
def test_kuairand_valid_files_round_trip(data: st.DataObject, rows: list[tuple]) -> None:
    text = kuairand_text(data, rows)
    ds = imported(lambda d: _put(d / "log_standard_a.csv", text), "kuairand")
    assert stored(ds) == expected([(str(u), str(v), t) for u, v, t, _, _ in rows], 1000)
    by_user = {str(u): sorted((r for r in rows if str(r[0]) == str(u)), key=lambda r: r[2]) for u, *_ in rows}
    users = ds.user_raw_ids if ds.user_raw_ids is not None else ds.user_ids
    for k, u in enumerate(users):
        want = [c | (lk << 1) for *_, c, lk in by_user[str(u)]]
        assert ds.actions[ds.offsets[k]:ds.offsets[k + 1]].tolist() == want
    same_after_round_trip(ds)


@SETTINGS
@given(data=st.data(), rows=KR_ROWS)
def test_kuairand_a_bad_line_is_refused_by_number(data: st.DataObject, rows: list[tuple]) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(rows) - 1))
    u, v, t, c, lk = rows[k]
    bad = data.draw(st.sampled_from([
        (u, v, -1, c, lk), (u, v, MAX_SECONDS * 1000, c, lk), (u, v, "1.5", c, lk), (u, v, "", c, lk),
        ('"11,5"', v, t, c, lk), (u, '"11,5"', t, c, lk), (u, v, t, '"1,0"', lk), ("x", v, t, c, lk),
        (u, 2**63, t, c, lk), (u, v, t, c, "yes"), ("NaN", v, t, c, lk), (u, v, "null", c, lk), ("", v, t, c, lk),
    ]))
    lines = kuairand_text(data, rows).splitlines(keepends=True)
    lines[k + 1] = kuairand_line(data, *bad)
    refused_at(lambda d: _put(d / "log_standard_a.csv", "".join(lines)), "kuairand", k + 2)


def _put(path: Path, text: str) -> Path:
    path.write_text(text)
    return path

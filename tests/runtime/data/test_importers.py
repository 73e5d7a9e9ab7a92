"""Importers on small files written here (whole datasets in the real formats: test_format_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.data.dataset import read_dataset, write_dataset
from grstack.runtime.data.importers import FORMATS, import_dataset
from grstack.runtime.data.importers.kuairand import ACTIONS
from grstack.runtime.errors import UserError

from .conftest import KUAIRAND_HEADER, RECBOLE_HEADER, kuairand_row

pytestmark = pytest.mark.unit


def seqs(ds) -> dict[int, list[int]]:
    """user -> raw item ids in sequence order (independent of the dense mapping)."""
    raw = ds.item_raw_ids
    return {int(u): [raw[i - 1].item() for i in ds.sequence(k)] for k, u in enumerate(ds.user_ids)}


def test_recbole_orders_by_time_stably_and_maps_items_densely(recbole_file: Path) -> None:
    ds = import_dataset("recbole", recbole_file.parent)  # a directory holding one .inter file
    assert ds.user_ids.tolist() == [1, 2]
    assert seqs(ds) == {1: [100, 7, 55], 2: [3, 7, 55, 100]}  # user 2: 7 and 55 tie at t=200, file order
    assert ds.timestamps.tolist() == [10, 50, 60, 100, 200, 200, 300]
    assert ds.item_raw_ids.tolist() == [3, 7, 55, 100]  # numeric order, not "100" < "3" < ...
    assert ds.sequence(1).tolist() == [1, 2, 3, 4]
    assert ds.num_items == 4 and ds.actions is None and ds.name == "toy"


def test_recbole_string_tokens_get_dense_ids_and_maps(write) -> None:
    rows = [("bob", "B07", 2.5), ("alice", "A01", 1.0), ("bob", "007", 1.5), ("alice", "7", 3.0),
            ("alice", "B07", 2.0), ("bob", "A01", 0.5)]
    path = write("x.inter", RECBOLE_HEADER + "".join(f"{u}\t{i}\t1\t{t}\n" for u, i, t in rows))
    ds = import_dataset("recbole", path)
    assert ds.user_ids.tolist() == [1, 2]
    assert ds.user_raw_ids.tolist() == ["alice", "bob"]
    assert ds.item_raw_ids.tolist() == ["007", "7", "A01", "B07"]  # "007" and "7" stay distinct
    assert seqs(ds) == {1: ["A01", "B07", "7"], 2: ["A01", "007", "B07"]}
    assert ds.timestamps.tolist() == [1, 2, 3, 0, 1, 2]  # float seconds floored after ordering


def test_recbole_without_timestamp_keeps_file_order(write) -> None:
    path = write("n.inter", "item_id:token\tuser_id:token\n5\t1\n3\t1\n9\t1\n")
    ds = import_dataset("recbole", path)
    assert seqs(ds) == {1: [5, 3, 9]}
    assert ds.timestamps.tolist() == [0, 1, 2]


def test_min_len_drops_short_users_and_their_items(write) -> None:
    rows = [(1, 10, 1), (1, 11, 2), (1, 12, 3), (2, 99, 1), (2, 10, 2)]
    path = write("m.inter", RECBOLE_HEADER + "".join(f"{u}\t{i}\t1\t{t}\n" for u, i, t in rows))
    ds = import_dataset("recbole", path)
    assert ds.user_ids.tolist() == [1]
    assert ds.item_raw_ids.tolist() == [10, 11, 12]  # item 99 was only seen by the dropped user
    assert ds.info["dropped_users"] == 1 and ds.info["dropped_events"] == 2 and ds.info["min_len"] == 3
    assert import_dataset("recbole", path, min_len=2).num_users == 2
    with pytest.raises(UserError, match="no user has at least 4 events"):
        import_dataset("recbole", path, min_len=4)


def test_seqtxt_uses_positions_as_timestamps(write) -> None:
    path = write("seq/Toy.txt", "3 5 6 7 5\n\n1 10 11 12\n")
    write("seq/SOURCE.txt", "documentation, not data\n")
    ds = import_dataset("seqtxt", path.parent)
    assert ds.user_ids.tolist() == [1, 3]
    assert seqs(ds) == {1: [10, 11, 12], 3: [5, 6, 7, 5]}
    assert ds.timestamps.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert ds.name == "Toy"


ML_DAT = "1::20::5::300\n1::21::3::100\n2::20::4::50\n1::22::4::200\n2::21::1::60\n2::23::1::60\n"


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("u.data", "1\t20\t5\t300\n1\t21\t3\t100\n2\t20\t4\t50\n1\t22\t4\t200\n2\t21\t1\t60\n2\t23\t1\t60\n"),
        ("ratings.dat", ML_DAT),
        ("ratings.csv", "userId,movieId,rating,timestamp\n1,20,5.0,300\n1,21,3.0,100\n2,20,4.0,50\n"
                        "1,22,4.0,200\n2,21,1.0,60\n2,23,1.0,60\n"),
        ("renamed.txt", ML_DAT),
    ],
)
def test_movielens_layouts(write, name: str, text: str) -> None:
    path = write(f"ml/{name}", text)
    src = path if name == "renamed.txt" else path.parent  # layout by content, or by file name in a directory
    ds = import_dataset("movielens", src)
    assert seqs(ds) == {1: [21, 22, 20], 2: [20, 21, 23]}
    assert ds.timestamps.tolist() == [100, 200, 300, 50, 60, 60]


def test_ratings_become_one_action_bit_per_level(write) -> None:
    ml = write("mlr/u.data", "1\t20\t5\t300\n1\t21\t3\t100\n2\t20\t4\t50\n1\t22\t4\t200\n2\t21\t1\t60\n"
                             "2\t23\t1\t70\n")
    ds = import_dataset("movielens", ml.parent, ratings=True)
    assert ds.action_names == ["rating_1", "rating_3", "rating_4", "rating_5"]  # the levels the file has
    # sequence order: user 1 rates 21 (3), 22 (4), 20 (5); user 2 rates 20 (4), 21 (1), 23 (1)
    assert ds.actions.tolist() == [1 << 1, 1 << 2, 1 << 3, 1 << 2, 1 << 0, 1 << 0]
    assert import_dataset("movielens", ml.parent).actions is None  # off by default

    rows = [(1, 10, 2.5, 1), (1, 11, 0.5, 2), (1, 12, 2.5, 3)]
    rb = write("rb/h.inter", RECBOLE_HEADER + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    ds = import_dataset("recbole", rb, ratings=True)
    assert ds.action_names == ["rating_0p5", "rating_2p5"] and ds.actions.tolist() == [2, 1, 2]


def test_ratings_errors_name_the_problem(write) -> None:
    no_rating = write("a/n.inter", "user_id:token\titem_id:token\ttimestamp:float\n1\t5\t1\n")
    with pytest.raises(UserError, match=r"n.inter, line 1: ratings as actions: the header has no 'rating' field"):
        import_dataset("recbole", no_rating, ratings=True)
    bad = write("b/b.inter", RECBOLE_HEADER + "1\t5\t4\t1\n1\t6\tgood\t2\n1\t7\t3\t3\n")
    with pytest.raises(UserError, match=r"b.inter, line 3: rating must be a finite number, got 'good'"):
        import_dataset("recbole", bad, ratings=True)
    assert import_dataset("recbole", bad).num_events == 3  # the rating is not read without ratings=True
    wide = write("c/w.inter", RECBOLE_HEADER + "".join(f"1\t{i}\t{i / 7}\t{i}\n" for i in range(20)))
    with pytest.raises(UserError, match="20 distinct values; ratings become one action bit per level, at most 16"):
        import_dataset("recbole", wide, ratings=True)
    with pytest.raises(UserError, match="format 'seqtxt' takes no option"):
        import_dataset("seqtxt", write("d/T.txt", "1 2 3 4\n"), ratings=True)


def test_kuairand_actions_and_millisecond_order(kuairand_dir: Path) -> None:
    ds = import_dataset("kuairand", kuairand_dir)  # the log_random file is not a standard log
    assert ds.action_names == list(ACTIONS)
    assert ds.action_names[:3] == ["click", "like", "long_view"]
    assert seqs(ds) == {5: [902, 901, 900], 7: [900, 33, 901]}  # same second, ordered by time_ms
    assert ds.timestamps.tolist() == [1_649_376_001, 1_649_376_001, 1_649_376_002,
                                      1_649_376_000, 1_649_376_000, 1_649_376_030]
    click, like, long_view, follow = 1, 2, 4, 8
    assert ds.actions.tolist() == [follow, click | like, click | long_view,
                                   0, click, click | like | long_view]
    assert ds.info["files"] == ["log_standard_4_08_to_4_21_1k.csv", "log_standard_4_22_to_5_08_1k.csv"]


def test_kuairand_clicks_only_and_single_file(kuairand_dir: Path) -> None:
    ds = import_dataset("kuairand", kuairand_dir, clicks_only=True, min_len=1)
    assert seqs(ds) == {5: [901, 900], 7: [33, 901]}
    assert ((ds.actions & 1) == 1).all()
    one = import_dataset("kuairand", kuairand_dir / "log_standard_4_08_to_4_21_1k.csv", min_len=1)
    assert seqs(one) == {5: [902, 901, 900], 7: [900]}


def test_kuairand_quoted_csv(write) -> None:
    header = ",".join(f'"{c}"' for c in KUAIRAND_HEADER.strip().split(","))
    rows = kuairand_row(1, 5, 3000, click=1) + kuairand_row(1, 6, 1000) + kuairand_row(1, 7, 2000)
    path = write("log_standard_q.csv", header + "\n" + rows.replace("1,5,", '"1","5",'))
    ds = import_dataset("kuairand", path)
    assert seqs(ds) == {1: [6, 7, 5]} and ds.actions.tolist() == [0, 0, 1]
    bad = write("log_standard_qbad.csv", header + "\n" + rows + '"1","x",20220408\n')
    with pytest.raises(UserError, match=r"line 5: expected 19 ','-separated fields, got 3"):
        import_dataset("kuairand", bad)


def test_kuairand_header_without_required_column(write) -> None:
    path = write("log_standard_bad.csv", KUAIRAND_HEADER.replace("video_id", "vid") + kuairand_row(1, 2, 3))
    with pytest.raises(UserError, match=r"log_standard_bad.csv, line 1: header lacks column\(s\) video_id"):
        import_dataset("kuairand", path)


@pytest.mark.parametrize(
    ("fmt", "name", "text", "message"),
    [
        ("recbole", "a.inter", RECBOLE_HEADER + "1\t2\t3\t4\n1\t2\t3\n",
         "line 3: expected 4 tab-separated fields, got 3"),
        ("recbole", "a.inter", RECBOLE_HEADER + "1\t2\t3\t4\n1\t2\t3\tsoon\n",
         "line 3: timestamp must be a finite number"),
        ("recbole", "a.inter", RECBOLE_HEADER + "1\t2\t3\tinf\n",
         "line 2: timestamp must be a finite number"),
        ("recbole", "a.inter", RECBOLE_HEADER + "1\t\t3\t4\n", "line 2: item_id must be a non-empty token"),
        ("recbole", "a.inter", RECBOLE_HEADER + "1\t2\t3\t4\n\n\t\t\t\n",  # only tabs: a row, not a blank line
         "line 4: timestamp must be a finite number"),
        ("recbole", "a.inter", "user_id\titem_id\n1\t2\n",
         "line 1: header field 'user_id' is not of the form"),
        ("recbole", "a.inter", "user:token\titem_id:token\n1\t2\n", "line 1: header has no 'user_id' field"),
        ("seqtxt", "s.txt", "1 2 3\n\n2 4 5.0 6\n", "line 3: ids must be integers, got '5.0'"),
        ("seqtxt", "s.txt", "1 2 3\n2 4 5\n1 7 8\n", "line 3: user 1 already appeared on line 1"),
        ("movielens", "u.data", "1\t2\t3\t4\n1\ttwo\t3\t4\n",
         "line 2: item_id must be an integer, got 'two'"),
        ("movielens", "ratings.dat", "1::2::3::4\n1::2::3\n",
         "line 2: expected 4 '::'-separated fields, got 3"),
        ("movielens", "ratings.dat", "1::2::3::4\n1::2::3::4.5\n", "line 2: timestamp must be an integer"),
        ("movielens", "ratings.csv", "userId,itemId,rating,timestamp\n1,2,3,4\n",
         "line 1: expected the header"),
        ("kuairand", "log_standard_a.csv", KUAIRAND_HEADER + kuairand_row(1, 2, 3) + "1,2,3\n",
         "line 3: expected 19 ','-separated fields, got 3"),
        ("kuairand", "log_standard_a.csv", KUAIRAND_HEADER + kuairand_row(1, 2, 3) + kuairand_row(1, 2, 3)
         .replace("1,", "u1,", 1), "line 3: user_id must be an integer, got 'u1'"),
    ],
)
def test_malformed_line_names_file_and_line(write, fmt: str, name: str, text: str, message: str) -> None:
    path = write(name, text)
    with pytest.raises(UserError) as err:
        import_dataset(fmt, path)
    assert str(err.value).startswith(f"{path}, ")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_and_missing_files(write, tmp_path: Path, fmt: str) -> None:
    empty = write(f"empty-{fmt}.txt", "\n \n")
    with pytest.raises(UserError, match=r"empty file"):
        import_dataset(fmt, empty)
    with pytest.raises(UserError, match=r"no such file or directory"):
        import_dataset(fmt, tmp_path / "missing")


def test_header_only_and_unknown_format_and_option(write) -> None:
    with pytest.raises(UserError, match="no events after the header"):
        import_dataset("recbole", write("h.inter", RECBOLE_HEADER))
    with pytest.raises(UserError, match="no events after the header"):
        import_dataset("kuairand", write("log_standard_h.csv", KUAIRAND_HEADER))
    known = r"\(known: amazon, kuairand, movielens, recbole, seqtxt\)"
    with pytest.raises(UserError, match=rf"unknown format 'csv' {known}"):
        import_dataset("csv", "anything")
    with pytest.raises(UserError, match="takes no option"):
        import_dataset("seqtxt", write("s.txt", "1 2 3 4\n"), clicks_only=True)


def test_directory_without_a_source_file(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    for fmt, what in [("recbole", "no .inter file"), ("seqtxt", "no .txt file"),
                      ("movielens", "no MovieLens ratings file"), ("kuairand", "no KuaiRand log_standard")]:
        with pytest.raises(UserError, match=what):
            import_dataset(fmt, tmp_path / "d")


def test_round_trip_keeps_sequences_and_maps(write, tmp_path: Path) -> None:
    rows = [("u1", "B", 1), ("u1", "A", 2), ("u1", "C", 3), ("u2", "A", 1), ("u2", "C", 1), ("u2", "B", 0)]
    path = write("x.inter", RECBOLE_HEADER + "".join(f"{u}\t{i}\t1\t{t}\n" for u, i, t in rows))
    ds = import_dataset("recbole", path)
    back = read_dataset(write_dataset(ds, tmp_path / "out"))
    for f in ("user_ids", "offsets", "item_ids", "timestamps", "item_raw_ids", "user_raw_ids"):
        assert np.array_equal(getattr(ds, f), getattr(back, f)), f
    assert back.info == ds.info and back.num_items == 3 and back.source == ds.source

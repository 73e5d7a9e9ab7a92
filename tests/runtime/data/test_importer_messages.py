"""Messages that name the real problem: an id wider than int64, a quoted CSV field holding the delimiter, a
side file with only a header, and ``data stats`` on a dataset whose files are directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from grstack.runtime.cli import main
from grstack.runtime.data.importers import import_dataset
from grstack.runtime.errors import UserError

from .conftest import KUAIRAND_HEADER, RECBOLE_HEADER, kuairand_row

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("token", [str(10**23), str(-(10**23)), str(2**63)])
def test_seqtxt_id_wider_than_int64(write, token: str) -> None:
    path = write("s.txt", f"1 2 3\n2 4 {token} 6\n")
    with pytest.raises(UserError) as err:
        import_dataset("seqtxt", path)
    assert str(err.value) == (f"{path}, line 2: id {token} does not fit in 64 bits "
                              f"(at most 9223372036854775807)")


def test_seqtxt_largest_int64_id_imports(write) -> None:
    ds = import_dataset("seqtxt", write("s.txt", f"1 2 3 {2**63 - 1}\n"))
    assert ds.item_raw_ids.tolist() == [2, 3, 2**63 - 1]


def test_kuairand_quoted_field_holding_a_comma(write) -> None:
    header = KUAIRAND_HEADER.strip().split(",")
    rows = [kuairand_row(1, 5, 3000).strip().split(","), kuairand_row(1, 6, 1000).strip().split(",")]
    quoted_tab = ['"11,5"' if c == "tab" else v for c, v in zip(header, rows[0], strict=True)]
    ok = write("a/log_standard_a.csv", KUAIRAND_HEADER + ",".join(quoted_tab) + "\n" + ",".join(rows[1]) + "\n")
    assert import_dataset("kuairand", ok, min_len=1).num_events == 2  # an unused column may hold "11,5"
    quoted_user = ['"11,5"' if c == "user_id" else v for c, v in zip(header, rows[0], strict=True)]
    bad = write("b/log_standard_b.csv", KUAIRAND_HEADER + ",".join(rows[1]) + "\n" + ",".join(quoted_user) + "\n")
    with pytest.raises(UserError) as err:
        import_dataset("kuairand", bad)
    assert str(err.value) == f"{bad}, line 3: user_id must be an integer, got '11,5'"
    unbalanced = write("c/log_standard_c.csv", KUAIRAND_HEADER + ",".join(rows[1]) + "\n" + '"1,5,3\n')
    with pytest.raises(UserError, match=r"log_standard_c.csv, line 3: "):
        import_dataset("kuairand", unbalanced)


def test_recbole_empty_id_and_int64_ids_in_movielens(write) -> None:
    path = write("u.data", f"1\t2\t5\t10\n1\t{10**20}\t5\t11\n")
    with pytest.raises(UserError, match=rf"u.data, line 2: item_id {10**20} does not fit in 64 bits"):
        import_dataset("movielens", path)
    path = write("e.inter", RECBOLE_HEADER + "1\t2\t3\t4\n\t3\t3\t5\n")
    with pytest.raises(UserError, match=r"e.inter, line 3: user_id must be a non-empty token"):
        import_dataset("recbole", path)


SIDE = {  # format -> (source files, side file, its header-only text, flag)
    "recbole": ({"x.inter": RECBOLE_HEADER + "1\t2\t3\t1\n1\t3\t3\t2\n1\t4\t3\t3\n"}, "x.item",
                "item_id:token\tcat:token\n", "item_features"),
    "recbole-user": ({"x.inter": RECBOLE_HEADER + "1\t2\t3\t1\n1\t3\t3\t2\n1\t4\t3\t3\n"}, "x.user",
                     "user_id:token\tgender:token\n", "user_features"),
    "kuairand": ({"log_standard_a.csv": KUAIRAND_HEADER + kuairand_row(1, 2, 1) + kuairand_row(1, 3, 2)
                  + kuairand_row(1, 4, 3)}, "video_features_basic_a.csv", "video_id,author_id,tag\n",
                 "item_features"),
    "movielens": ({"ratings.csv": "userId,movieId,rating,timestamp\n1,2,3,1\n1,3,3,2\n1,4,3,3\n"}, "movies.csv",
                  "movieId,title,genres\n", "item_features"),
    "seqtxt": ({"a.txt": "1 2 3 4\n"}, "a_item2attributes.json", "{}", "item_features"),
}


@pytest.mark.parametrize("case", list(SIDE))
def test_side_file_with_only_a_header(case: str, tmp_path: Path, write, capsys) -> None:
    sources, side, text, flag = SIDE[case]
    for name, body in sources.items():
        write(f"src/{name}", body)
    side_path = write(f"src/{side}", text)
    fmt = case.split("-")[0]
    kind = flag.split("_")[0]
    with pytest.raises(UserError) as err:
        import_dataset(fmt, tmp_path / "src", **{flag: "auto"})
    assert str(err.value).startswith(f"{side_path}: lists no {kind} (nothing after the header)")
    out = tmp_path / "out"
    argv = ["data", "import", "--format", fmt, str(tmp_path / "src"), "--out", str(out),
            f"--{kind}-features", str(side_path)]
    assert main(argv) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith(f"error: {side_path}: lists no {kind}") and err_text.count("\n") == 1
    assert not out.exists()


def test_stats_of_a_dataset_whose_files_are_directories(tmp_path: Path, capsys) -> None:
    ds = tmp_path / "ds"
    assert main(["data", "synth", "--preset", "tiny", "--out", str(ds)]) == 0
    capsys.readouterr()
    vocab = ds / "features_vocab.parquet"
    vocab.unlink()
    vocab.mkdir()
    assert main(["data", "stats", str(ds)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {vocab}: a directory, but meta.json names it as the item features' Parquet file\n"
    part = ds / "part-00000.parquet"
    part.unlink()
    part.mkdir()
    assert main(["data", "stats", str(ds)]) == 2
    assert capsys.readouterr().err == f"error: {part}: not a file (a dataset's part-*.parquet are Parquet files)\n"
    assert main(["data", "stats", str(part / "..")]) == 2
    assert main(["data", "stats", str(ds / "meta.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "meta.json" in err and "does not exist" not in err

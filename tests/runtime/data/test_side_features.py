"""Side features: the on-disk round trip, attach, each side-file reader (good and malformed), discovery and
``import_dataset``'s wiring (``grstack data import/stats`` on whole datasets: test_format_fixtures.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from grstack.runtime.cli import main
from grstack.runtime.data.dataset import from_sequences, read_dataset, read_meta, write_dataset
from grstack.runtime.data.features import (
    FeatureField,
    Features,
    RawFeatures,
    attach,
    coverage,
    csr_from_lists,
)
from grstack.runtime.data.importers import find_side_file, import_dataset
from grstack.runtime.data.importers.side import (
    read_item2attributes,
    read_kuairand_side,
    read_movielens_side,
    read_recbole_side,
)
from grstack.runtime.errors import UserError

from .conftest import KUAIRAND_HEADER, RECBOLE_HEADER, kuairand_row

pytestmark = pytest.mark.unit


def rows(raw: RawFeatures, name: str) -> dict[str, list[str]]:
    """key -> tokens of one field, as the reader gave them."""
    offs, tokens = raw.fields[name]
    return {str(k): tokens[offs[i] : offs[i + 1]].tolist() for i, k in enumerate(raw.keys)}


def tokens_of(feats: Features, name: str) -> list[list[str]]:
    """Per row, the raw tokens of one field (independent of the value numbering)."""
    f = next(x for x in feats.fields if x.name == name)
    return [f.vocab[f.row(r) - 1].tolist() for r in range(feats.num_rows)]


# -- features.py ----------------------------------------------------------------------------------------------
def _field(name: str, per_row: list[list[str]]) -> FeatureField:
    offs, tokens = csr_from_lists(per_row)
    vocab, values = np.unique(tokens, return_inverse=True)
    return FeatureField(name, offs, values.reshape(-1).astype(np.int64) + 1, vocab)


def test_features_round_trip_with_users_and_a_subset_of_part_files(tmp_path: Path) -> None:
    items = [np.array([3, 1, 2]), np.array([2, 2]), np.array([1])]
    times = [np.array([5, 5, 9]), np.array([1, 2]), np.array([0])]
    ds = from_sequences([10, 11, 12], items, times, num_items=3)
    ds.item_features = Features("item", 3, [_field("cat", [["b", "a"], [], ["a"]]), _field("brand", [["x"]] * 3)])
    ds.user_features = Features("user", 3, [_field("age", [["18"], ["25"], []])])
    out = write_dataset(ds, tmp_path / "d", rows_per_file=2)
    meta = read_meta(out)
    assert meta["item_features"] == {"file": "item_features.parquet", "fields": {"cat": 2, "brand": 1}}
    assert meta["user_features"]["fields"] == {"age": 2}
    back = read_dataset(out)
    assert tokens_of(back.item_features, "cat") == [["b", "a"], [], ["a"]]
    assert back.item_features.names == ["cat", "brand"] and back.item_features.sizes == {"cat": 2, "brand": 1}
    assert tokens_of(back.user_features, "age") == [["18"], ["25"], []]
    part = read_dataset(out, files=["part-00001.parquet"])  # user 12 only; items stay whole
    assert part.user_ids.tolist() == [12] and tokens_of(part.user_features, "age") == [[]]
    assert part.item_features.num_rows == 3


def test_attach_matches_raw_ids_numbers_kept_values_and_names_unknown_fields() -> None:
    offs, tokens = csr_from_lists([["red", "big"], ["blue"], ["green"]])
    raw = RawFeatures("item", np.array(["7", "3", "9"]), {"tag": (offs, tokens)}, "side.item")
    feats = attach(raw, np.array([9, 5, 7]))  # integer raw ids against string keys; 5 is not listed
    assert tokens_of(feats, "tag") == [["green"], [], ["red", "big"]]
    f = feats.fields[0]
    assert f.vocab.tolist() == ["big", "green", "red"]  # "blue" (item 3, not in the dataset) gets no value
    assert f.values.tolist() == [2, 3, 1] and f.offsets.tolist() == [0, 1, 1, 3]
    assert coverage(feats) == {"tag": pytest.approx(2 / 3)}
    with pytest.raises(UserError, match=r"side.item: no field\(s\) colour \(fields: tag\)"):
        attach(raw, np.array([9]), ["colour"])


# -- readers --------------------------------------------------------------------------------------------------
ITEM_HEADER = "item_id:token\ttitle:token_seq\tyear:token\tprice:float\tgenre:token_seq\n"


def test_recbole_side_tokens_sequences_empty_cells_and_numeric_fields(write) -> None:
    path = write("x.item", ITEM_HEADER + "1\tToy Story\t1995\t9.5\tAnimation Comedy\n"
                                         "\n"
                                         "2\tHeat\t\t3\t\n"
                                         "B07\t\t2001\t1\tDrama\n")
    raw = read_recbole_side(path, "item")
    assert list(raw.fields) == ["title", "year", "genre"]  # price (float) is not categorical
    assert rows(raw, "genre") == {"1": ["Animation", "Comedy"], "2": [], "B07": ["Drama"]}
    assert rows(raw, "year") == {"1": ["1995"], "2": [], "B07": ["2001"]}
    assert list(read_recbole_side(path, "item", ["genre"]).fields) == ["genre"]
    with pytest.raises(UserError, match=r"x.item: field 'price' has type float, not a categorical feature"):
        read_recbole_side(path, "item", ["price"])
    with pytest.raises(UserError, match=r"no field 'colour' \(categorical fields: title, year, genre\)"):
        read_recbole_side(path, "item", ["colour"])


@pytest.mark.parametrize(("text", "line", "what"), [
    ("1\tA\t1\t1\tx\n2\tB\t2\t1\n", 3, "expected 5 tab-separated fields, got 4"),
    ("1\tA\t1\t1\tx\n\n\t\t\t\t\n", 4, "item_id must be a non-empty token, got ''"),
    ("1\tA\t1\t1\tx\n2\tB\t2\t1\ty\n1\tC\t3\t1\tz\n", 4, "item_id 1 already appeared on line 2"),
])
def test_recbole_side_malformed_rows_name_the_line(write, text: str, line: int, what: str) -> None:
    path = write("bad.item", ITEM_HEADER + text)
    with pytest.raises(UserError) as err:
        read_recbole_side(path, "item")
    assert str(err.value) == f"{path}, line {line}: {what}"


def test_recbole_side_header_problems(write) -> None:
    with pytest.raises(UserError, match=r"bad.user, line 1: header has no 'user_id' field"):
        read_recbole_side(write("bad.user", "uid:token\tage:token\n1\t20\n"), "user")
    with pytest.raises(UserError, match=r"line 1: field 'age' has unknown type 'int'"):
        read_recbole_side(write("b2.user", "user_id:token\tage:int\n1\t20\n"), "user")
    raw = read_recbole_side(write("k.user", "uid:token\tage:token\n1\t20\n"), "user", key="uid")
    assert rows(raw, "age") == {"1": ["20"]}


def test_item2attributes_good_and_malformed(write) -> None:
    raw = read_item2attributes(write("a_item2attributes.json", '{"4": [1, 2], "83": [], "5": [2]}'))
    assert rows(raw, "attribute") == {"4": ["1", "2"], "83": [], "5": ["2"]}
    bad = write("b.json", '{"4": [1, 2],\n "83": [3,]\n}')
    with pytest.raises(UserError) as err:
        read_item2attributes(bad)
    assert str(err.value).startswith(f"{bad}, line 2: invalid JSON")
    with pytest.raises(UserError, match=r"item '83': attributes must be a list of integers"):
        read_item2attributes(write("c.json", '{"4": [1], "83": ["x"]}'))
    with pytest.raises(UserError, match=r"item '5': attributes must be a list of integers"):
        read_item2attributes(write("d.json", '{"5": 3}'))
    with pytest.raises(UserError, match=r"no field 'brand' \(categorical fields: attribute\)"):
        read_item2attributes(write("e.json", "{}"), "item", ["brand"])


VIDEO_HEADER = ("video_id,author_id,video_type,upload_dt,upload_type,visible_status,video_duration,"
                "server_width,server_height,music_id,music_type,tag\n")


def test_kuairand_side_multi_valued_tags_integral_floats_and_numeric_columns(write) -> None:
    path = write("video_features_basic_1k.csv", VIDEO_HEADER
                 + '10,7,NORMAL,2022-04-10,ShortImport,1,17200.0,720,1280,99,9.0,"28,9"\n'
                 + "11,8,AD,2022-04-11,Web,1,9100.0,720,1280,,,65\n"
                 + "12,9,NORMAL,2022-04-12,Web,1,8200.0,720,1280,101,3.0,\n")
    raw = read_kuairand_side(path, "item")
    assert list(raw.fields) == ["author_id", "video_type", "upload_type", "visible_status", "music_id",
                                "music_type", "tag"]
    assert rows(raw, "tag") == {"10": ["28", "9"], "11": ["65"], "12": []}
    assert rows(raw, "music_type") == {"10": ["9"], "11": [], "12": ["3"]}
    with pytest.raises(UserError, match=r"field 'video_duration' is numeric or a date"):
        read_kuairand_side(path, "item", ["tag", "video_duration"])
    users = write("user_features_1k.csv", "user_id,user_active_degree,follow_user_num,onehot_feat0\n"
                                          "1,high_active,12,3\n2,UNKNOWN,0,\n")
    raw = read_kuairand_side(users, "user")
    assert list(raw.fields) == ["user_active_degree", "onehot_feat0"]  # follow_user_num is a count
    assert rows(raw, "onehot_feat0") == {"1": ["3"], "2": []}


@pytest.mark.parametrize(("text", "line", "what"), [
    ('10,7,NORMAL,2022-04-10,Web,1,1.0,720,1280,99,9,"28,9"\n11,8,AD,x,Web,1,1.0,720,1280,1,1,28,9\n', 3,
     "expected 12 ','-separated fields, got 13"),
    ("10,7,NORMAL,2022-04-10,Web,1,1.0,720,1280,99,9,2\nv11,8,AD,x,Web,1,1.0,720,1280,1,1,9\n", 3,
     "video_id must be an integer, got 'v11'"),
    ("10,7,NORMAL,d,Web,1,1.0,720,1280,99,9,2\n11,8,AD,d,Web,1,1,720,1280,1,1,9\n10,7,AD,d,Web,1,1,1,1,1,1,9\n",
     4, "video_id 10 already appeared on line 2"),
])
def test_kuairand_side_malformed_rows_name_the_line(write, text: str, line: int, what: str) -> None:
    path = write("video_features_basic_x.csv", VIDEO_HEADER + text)
    with pytest.raises(UserError) as err:
        read_kuairand_side(path, "item")
    assert str(err.value) == f"{path}, line {line}: {what}"


def test_movielens_side_files(write) -> None:
    flags = ["0"] * 19
    action_comedy = flags.copy()
    action_comedy[1] = action_comedy[5] = "1"
    item = write("u.item", f"1|Toy Story (1995)|01-Jan-1995||http://x|{'|'.join(action_comedy)}\n"
                           f"2|GoldenEye (1995)|01-Jan-1995||http://x|{'|'.join(flags)}\n")
    assert rows(read_movielens_side(item, "item"), "genre") == {"1": ["Action", "Comedy"], "2": []}
    bad = write("bad/u.item", f"1|T|d||u|{'|'.join(flags)}\n2|T|d||u|{'|'.join([*flags[:-1], '2'])}\n")
    with pytest.raises(UserError) as err:
        read_movielens_side(bad, "item")
    assert str(err.value) == f"{bad}, line 2: genre flag Western must be 0 or 1, got '2'"
    user = write("u.user", "1|24|M|technician|85711\n2|53|F|other|94043\n")
    assert rows(read_movielens_side(user, "user"), "occupation") == {"1": ["technician"], "2": ["other"]}
    movies = write("m/movies.dat", "1::Toy Story (1995)::Animation|Children's\n2::Heat (1995)::Action\n")
    assert rows(read_movielens_side(movies, "item"), "genre") == {"1": ["Animation", "Children's"],
                                                                  "2": ["Action"]}
    users = write("m/users.dat", "1::F::1::10::48067\n2::M\n")
    with pytest.raises(UserError) as err:
        read_movielens_side(users, "user")
    assert str(err.value) == f"{users}, line 2: expected 5 '::'-separated fields, got 2"
    csv_movies = write("c/movies.csv", 'movieId,title,genres\n1,"Heat, The (1995)",Action|Crime\n'
                                      "2,X (2000),(no genres listed)\n")
    assert rows(read_movielens_side(csv_movies, "item"), "genre") == {"1": ["Action", "Crime"], "2": []}


# -- discovery and import_dataset -----------------------------------------------------------------------------
def test_discovery_finds_one_file_and_names_the_problem_otherwise(recbole_file: Path, write) -> None:
    src = recbole_file.parent
    assert find_side_file("recbole", "item", src) is None
    with pytest.raises(UserError, match=r"no item side file for format 'recbole' \(looked for \*\.item\)"):
        import_dataset("recbole", src, item_features="auto")
    write("src/toy.item", "item_id:token\tcat:token\n7\ta\n")
    assert find_side_file("recbole", "item", recbole_file) == src / "toy.item"  # from the .inter file too
    write("src/other.item", "item_id:token\tcat:token\n7\tb\n")
    with pytest.raises(UserError, match=r"several item side files for format 'recbole' \(other.item, toy.item\)"):
        import_dataset("recbole", src, item_features="auto")
    assert find_side_file("seqtxt", "user", src) is None
    with pytest.raises(UserError, match=r"format 'seqtxt' has no user side-feature reader"):
        import_dataset("seqtxt", src, user_features="auto")
    with pytest.raises(UserError, match=r"item fields given without a item side file"):
        import_dataset("recbole", src / "toy.inter", item_fields=["cat"])


def test_import_dataset_attaches_records_coverage_and_writes(recbole_file: Path, write, tmp_path: Path) -> None:
    # Items 3, 7, 55, 100 are in the data; 999 is only in the side file; 55 is missing from it.
    write("src/toy.item", "item_id:token\tcat:token_seq\tscore:float\n"
                          "100\tx y\t1\n7\ty\t2\n3\t\t3\n999\tz\t4\n")
    write("src/toy.user", "user_id:token\tgender:token\n2\tF\n")
    ds = import_dataset("recbole", recbole_file, item_features="auto", user_features="auto")
    assert ds.item_raw_ids.tolist() == [3, 7, 55, 100]
    assert tokens_of(ds.item_features, "cat") == [[], ["y"], [], ["x", "y"]]
    assert ds.item_features.sizes == {"cat": 2}  # z belongs to no dataset item
    assert tokens_of(ds.user_features, "gender") == [[], ["F"]]
    assert ds.info["item_features"] == {"file": str(recbole_file.parent / "toy.item"), "coverage": {"cat": 0.5}}
    assert ds.info["user_features"]["coverage"] == {"gender": 0.5}
    back = read_dataset(write_dataset(ds, tmp_path / "out"))
    assert tokens_of(back.item_features, "cat") == [[], ["y"], [], ["x", "y"]]
    with pytest.raises(UserError, match=r"field 'score' has type float"):
        import_dataset("recbole", recbole_file, item_features="auto", item_fields=["score"])
    twice = import_dataset("recbole", recbole_file, item_features="auto", item_fields=["cat", "cat"])
    assert twice.item_features.names == ["cat"]
    with pytest.raises(UserError, match=r"item fields: an empty list"):
        import_dataset("recbole", recbole_file, item_features="auto", item_fields=[])
    with pytest.raises(UserError, match=r"nope.item: no such item side file"):
        import_dataset("recbole", recbole_file, item_features=recbole_file.parent / "nope.item")


def test_kuairand_import_with_video_features(write) -> None:
    logs = write("k/log_standard_4_08_to_4_21_1k.csv", KUAIRAND_HEADER + "".join(
        kuairand_row(1, v, 1000 * t) for t, v in enumerate([10, 11, 12, 10])))
    write("k/video_features_basic_1k.csv", VIDEO_HEADER + '10,7,NORMAL,d,Web,1,1.0,720,1280,99,9.0,"28,9"\n'
                                                          "12,9,AD,d,Web,1,1.0,720,1280,,,5\n")
    ds = import_dataset("kuairand", logs.parent, item_features="auto", item_fields=["tag", "video_type"])
    assert ds.item_features.names == ["tag", "video_type"]
    assert tokens_of(ds.item_features, "tag") == [["28", "9"], [], ["5"]]
    assert coverage(ds.item_features) == {"tag": pytest.approx(2 / 3), "video_type": pytest.approx(2 / 3)}


def test_cli_feature_flag_errors_exit_2_with_one_line(recbole_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    assert main(["data", "import", "--format", "recbole", str(recbole_file), "--out", str(out),
                 "--item-fields", "cat"]) == 2
    assert "--item-fields needs --item-features FILE|auto" in capsys.readouterr().err
    assert main(["data", "import", "--format", "seqtxt", str(recbole_file), "--out", str(out),
                 "--user-features", "auto"]) == 2
    err = capsys.readouterr().err
    assert "format 'seqtxt' has no user side-feature reader" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_importer_without_features_is_unchanged(write) -> None:
    ds = import_dataset("recbole", write("p.inter", RECBOLE_HEADER + "1\t5\t1\t1\n1\t6\t1\t2\n1\t7\t1\t3\n"))
    assert ds.item_features is None and ds.user_features is None and "item_features" not in ds.info

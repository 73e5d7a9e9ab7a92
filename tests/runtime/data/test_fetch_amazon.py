"""The Amazon 2014 ratings importer (``ratings_<Category>.csv``, what ``fetch amazon-books`` imports): string
ids kept as raw ids, seconds, and every malformed row refused by its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from grstack.runtime.data.importers import import_dataset
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


def test_string_ids_times_and_ratings(tmp_path: Path) -> None:
    path = tmp_path / "ratings_Books.csv"
    path.write_text("U2,0000000116,5.0,1300000300\nU1,B000,4.0,1300000200\nU2,0000000117,3.0,1300000100\n"
                    "U1,0000000116,1.0,1300000100\nU1,0000000117,2.0,1300000400\nU2,B000,5.0,1300000200\n")
    ds = import_dataset("amazon", tmp_path, ratings=True)  # a directory holding one ratings_*.csv
    assert ds.name == "ratings_Books" and ds.num_users == 2 and ds.num_events == 6
    assert list(ds.item_raw_ids) == ["0000000116", "0000000117", "B000"]  # leading zeros kept: ASINs
    assert list(ds.user_raw_ids) == ["U1", "U2"]
    assert ds.timestamps.tolist() == [1300000100, 1300000200, 1300000400, 1300000100, 1300000200, 1300000300]
    assert ds.item_ids.tolist() == [1, 3, 2, 2, 3, 1]
    assert ds.action_names == ["rating_1", "rating_2", "rating_3", "rating_4", "rating_5"]


@pytest.mark.parametrize(("text", "message"), [
    ("a,b,5.0,100\na,,5.0,101\n", "line 2: item_id must be a non-empty token, got ''"),
    ("a,b,5.0,100\na,c,5.0,1e9\n", "line 2: timestamp must be an integer, got '1e9'"),
    ("a,b,5.0,100\n\na,c,5.0\n", "line 3: expected 4 ','-separated fields, got 3"),
    ("a,b,five,100\n", "line 1: rating must be a finite number, got 'five'"),
    ("a,b,5.0,-100\n", "line 1: timestamp -100 is negative"),
])
def test_malformed_rows_name_their_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "ratings_X.csv"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        import_dataset("amazon", path, min_len=1)
    assert str(err.value).startswith(f"{path}, ") and message in str(err.value)


def test_directory_and_filter_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"expected one Amazon ratings_\*\.csv file, found none"):
        import_dataset("amazon", tmp_path)
    (tmp_path / "ratings_A.csv").write_text("a,b,5.0,100\n")
    (tmp_path / "ratings_B.csv").write_text("a,b,5.0,100\n")
    with pytest.raises(UserError, match=r"found 2 files \(ratings_A\.csv, ratings_B\.csv\)"):
        import_dataset("amazon", tmp_path)
    with pytest.raises(UserError, match="no rating has an item with >= 5 and a user with >= 5 ratings"):
        import_dataset("amazon", tmp_path / "ratings_A.csv", min_item_count=5, min_user_count=5)

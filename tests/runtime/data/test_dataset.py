"""The Parquet format: round trips, id maps, atomic writes, and the invariants validate() enforces."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grstack.runtime.data import dataset as dataset_mod
from grstack.runtime.data.dataset import from_sequences, read_dataset, read_item_map, read_meta, write_dataset
from grstack.runtime.errors import UserError

pytestmark = pytest.mark.unit


def _ds(**kw):
    items = [np.array([3, 1, 2]), np.array([2, 2]), np.array([1])]
    times = [np.array([5, 5, 9]), np.array([1, 2]), np.array([0])]
    return from_sequences([10, 11, 12], items, times, num_items=3, **kw)


def test_round_trip_with_maps_and_parts(tmp_path) -> None:
    ds = _ds(item_raw_ids=np.array(["c", "a", "b"]), user_raw_ids=np.array(["x", "y", "z"]), info={"k": 1})
    out = write_dataset(ds, tmp_path / "d", rows_per_file=2)
    assert sorted(p.name for p in out.iterdir()) == ["items.parquet", "meta.json", "part-00000.parquet",
                                                     "part-00001.parquet", "users.parquet"]
    back = read_dataset(out)
    for f in ("user_ids", "offsets", "item_ids", "timestamps", "item_raw_ids", "user_raw_ids"):
        assert np.array_equal(getattr(ds, f), getattr(back, f)), f
    assert back.info == {"k": 1}
    assert read_item_map(out).tolist() == ["c", "a", "b"]
    part = read_dataset(out, files=["part-00001.parquet"])  # one rank's share
    assert part.user_ids.tolist() == [12] and part.user_raw_ids.tolist() == ["z"]
    assert read_meta(out)["item_map"] == "items.parquet"
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_integer_item_map_is_int64(tmp_path) -> None:
    out = write_dataset(_ds(item_raw_ids=np.array([30, 10, 20])), tmp_path / "d")
    assert str(pq.read_table(out / "items.parquet").schema.field("raw_id").type) == "int64"
    assert read_item_map(out).tolist() == [30, 10, 20]


def test_validate_rejects_time_disorder_and_bad_maps() -> None:
    with pytest.raises(UserError, match="timestamps of user 11 are not time-ordered"):
        from_sequences([10, 11], [np.array([1, 2]), np.array([1, 2])], [np.array([5, 6]), np.array([3, 1])],
                       num_items=2)
    # a step back in time between two users is fine
    from_sequences([10, 11], [np.array([1]), np.array([2])], [np.array([9]), np.array([1])], num_items=2)
    with pytest.raises(UserError, match="item id map has 2 entries, expected 3"):
        _ds(item_raw_ids=np.array([1, 2]))


def test_write_refuses_non_empty_out_and_leaves_nothing_on_failure(tmp_path, monkeypatch) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(UserError, match="exists and is not empty"):
        write_dataset(_ds(), tmp_path / "full")

    calls = []

    def failing_write(table, where, **kw):
        calls.append(where)
        if len(calls) == 2:
            raise OSError("disk full")
        return pq.write_table(table, where, **kw)

    monkeypatch.setattr(dataset_mod.pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_dataset(_ds(), tmp_path / "new", rows_per_file=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no output dir, no temporary sibling


def test_read_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        read_dataset(tmp_path / "nope")
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match=r"meta\.json is missing"):
        read_dataset(tmp_path / "d")
    out = write_dataset(_ds(), tmp_path / "ok")
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "num_items": "3"}))
    with pytest.raises(UserError, match="'num_items' missing or not an integer"):
        read_dataset(out)


def test_large_sets_are_split_into_parts_by_events(tmp_path) -> None:
    lengths = [5, 1, 1, 7, 2, 2]  # with at most 6 events a part: [5, 1] [1] [7] [2, 2]
    items = [np.ones(n, dtype=np.int64) for n in lengths]
    ds = from_sequences(list(range(6)), items, [np.arange(n) for n in lengths], num_items=1)
    out = write_dataset(ds, tmp_path / "d", events_per_file=6)
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    assert [read_dataset(out, files=[p]).user_ids.tolist() for p in parts] == [[0, 1], [2], [3], [4, 5]]
    assert np.array_equal(read_dataset(out).offsets, ds.offsets)


def test_read_rejects_wrong_column_types(tmp_path) -> None:
    out = write_dataset(_ds(), tmp_path / "d")
    part = out / "part-00000.parquet"
    table = pq.read_table(part)
    as_text = pa.array([[str(i) for i in row] for row in table.column("item_ids").to_pylist()])
    pq.write_table(table.set_column(1, "item_ids", as_text), part)
    expected = (r"part-00000\.parquet: column 'item_ids' has type list<\w+: string>, "
                r"expected list<item: int64>$")
    with pytest.raises(UserError, match=expected):
        read_dataset(out)

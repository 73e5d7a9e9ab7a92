"""Amazon review data (2014, UCSD/SNAP) ratings-only files: ``ratings_<Category>.csv``, headerless
``user,item,rating,timestamp`` rows (user and item are string tokens: reviewer ids and ASINs; times are Unix
seconds). Every rating counts as one interaction.

``min_item_count`` / ``min_user_count`` reproduce the filter of Meta's generative-recommenders
(``AmazonDataProcessor``): one pass that keeps the ratings whose item and whose user each have at least that
many ratings in the whole file (counts taken before either filter), not an iterated k-core. Its last step,
dropping users left with fewer than 5 ratings, is ``min_len=5``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.importers.common import (
    DEFAULT_MIN_LEN,
    Events,
    RowLines,
    build_dataset,
    fields_check,
    locate_bad_line,
    numbered_lines,
    rating_actions,
    timestamp_scale,
)
from grstack.runtime.errors import UserError

NAMES = ["user_id", "item_id", "rating", "timestamp"]
PATTERN = "ratings_*.csv"


def find_ratings(src: Path) -> Path:
    if src.is_file():
        return src
    found = sorted(src.glob(PATTERN))
    if len(found) != 1:
        what = f"{len(found)} files ({', '.join(f.name for f in found)})" if found else "none"
        raise UserError(f"{src}: expected one Amazon {PATTERN} file, found {what}")
    return found[0]


def _blank(path: Path) -> bool:
    """Only whitespace (read in blocks: the file may be large)."""
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            if block.strip():
                return False
    return True


def _counts_at_least(codes: pa.ChunkedArray, minimum: int) -> np.ndarray:
    """Per row: does its token occur at least ``minimum`` times in the column?"""
    encoded = pc.dictionary_encode(codes).combine_chunks()
    idx = encoded.indices.to_numpy()
    return np.bincount(idx, minlength=len(encoded.dictionary))[idx] >= minimum


def import_amazon(src: Path, *, min_len: int = DEFAULT_MIN_LEN, name: str | None = None, ratings: bool = False,
                  min_item_count: int = 0, min_user_count: int = 0, timestamp_unit: str = "s") -> SequenceDataset:
    """With ``ratings``, each event's rating becomes its action bits (:func:`rating_actions`)."""
    path = find_ratings(src)
    if _blank(path):
        raise UserError(f"{path}: empty file (no events)")
    check = fields_check(",", NAMES, ints=["timestamp"], numbers=["rating"], tokens=["user_id", "item_id"],
                         unquote=True)
    try:
        table = pa_csv.read_csv(
            path,
            read_options=pa_csv.ReadOptions(column_names=NAMES, block_size=64 << 20),
            convert_options=pa_csv.ConvertOptions(
                column_types={"user_id": pa.string(), "item_id": pa.string(), "rating": pa.float64(),
                              "timestamp": pa.int64()}),
        )
    except pa.ArrowInvalid as exc:
        raise locate_bad_line(path, numbered_lines(path), check, str(exc)) from None
    if table.num_rows == 0:
        raise UserError(f"{path}: empty file (no events)")
    users, items = table.column("user_id"), table.column("item_id")
    if pc.any(pc.or_(pc.equal(users, ""), pc.equal(items, ""))).as_py():
        raise locate_bad_line(path, numbered_lines(path), check, "empty user or item id")
    values = table.column("rating").to_numpy()
    if not np.isfinite(values).all():
        raise locate_bad_line(path, numbered_lines(path), check, "non-finite rating")
    times = table.column("timestamp").to_numpy()
    scale = timestamp_scale(times, timestamp_unit, RowLines(path))
    raw_events = table.num_rows
    if min_item_count > 1 or min_user_count > 1:
        keep = _counts_at_least(items, min_item_count) & _counts_at_least(users, min_user_count)
        if not keep.any():
            raise UserError(f"{path}: no rating has an item with >= {min_item_count} and a user with >= "
                            f"{min_user_count} ratings")
        mask = pa.array(keep)
        users, items = users.filter(mask), items.filter(mask)
        values, times = values[keep], times[keep]
    ev = Events(users=np.asarray(users.to_numpy(), dtype=str), items=np.asarray(items.to_numpy(), dtype=str),
                times=times, seconds_per_unit=scale)
    if ratings:
        ev.actions, ev.action_names = rating_actions(path, values)
    return build_dataset(ev, src=path, fmt="amazon", name=name or path.stem, min_len=min_len,
                         info={"min_item_count": min_item_count, "min_user_count": min_user_count,
                               "file_events": raw_events})

"""MovieLens ratings: ``ratings.dat`` (``::``-separated, ML-1M/10M), ``u.data`` (tab-separated, ML-100K)
and ``ratings.csv`` (with a header, ML-20M/25M/32M). Every rating counts as one interaction.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.importers.common import (
    DEFAULT_MIN_LEN,
    Events,
    RowLines,
    TimestampUnit,
    build_dataset,
    fields_check,
    locate_bad_line,
    numbered_lines,
    rating_actions,
    timestamp_scale,
    unit_of,
)
from grstack.runtime.errors import UserError

NAMES = ["user_id", "item_id", "rating", "timestamp"]
CSV_HEADER = "userId,movieId,rating,timestamp"
# layout -> (field delimiter in the file, lines before the data)
LAYOUTS = {"dat": ("::", 0), "udata": ("\t", 0), "csv": (",", 1)}
FILE_NAMES = {"ratings.dat": "dat", "u.data": "udata", "ratings.csv": "csv"}


def _first_line(path: Path) -> str:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.rstrip("\r\n")
    raise UserError(f"{path}: empty file (no events)")


def detect(src: Path) -> tuple[Path, str]:
    """(ratings file, layout) from a directory or a file, by file name, else by the first line."""
    if src.is_dir():
        for fname, layout in FILE_NAMES.items():
            if (src / fname).is_file():
                return src / fname, layout
        raise UserError(f"{src}: no MovieLens ratings file ({', '.join(FILE_NAMES)})")
    first = _first_line(src)
    if src.name in FILE_NAMES:
        return src, FILE_NAMES[src.name]
    if "::" in first:
        return src, "dat"
    if first.replace(" ", "") == CSV_HEADER:
        return src, "csv"
    if "\t" in first:
        return src, "udata"
    raise UserError(f"{src}: cannot tell the MovieLens layout from line 1 (expected '::', tab or a "
                    f"'{CSV_HEADER}' header)")


def import_movielens(src: Path, *, min_len: int = DEFAULT_MIN_LEN, name: str | None = None,
                     ratings: bool = False, timestamp_unit: TimestampUnit = "auto") -> SequenceDataset:
    """With ``ratings``, each event's rating becomes its action bits (:func:`rating_actions`). MovieLens
    times are seconds; ``timestamp_unit`` "auto" checks that (:func:`timestamp_scale`)."""
    path, layout = detect(src)
    delimiter, skip = LAYOUTS[layout]
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"{path}: empty file (no events)")
    if skip:
        header = _first_line(path)
        if header.replace(" ", "") != CSV_HEADER:
            raise UserError(f"{path}, line 1: expected the header '{CSV_HEADER}', got {header!r}")
    if layout == "dat":
        data = data.replace(b"::", b"\t")  # pyarrow needs a one-character delimiter; line numbers unchanged
    check = fields_check(delimiter, NAMES, ints=["user_id", "item_id", "timestamp"], numbers=["rating"])
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data),
            read_options=pa_csv.ReadOptions(skip_rows=skip, column_names=NAMES),
            parse_options=pa_csv.ParseOptions(delimiter="\t" if layout == "dat" else delimiter,
                                              quote_char=False),
            convert_options=pa_csv.ConvertOptions(
                column_types={"user_id": pa.int64(), "item_id": pa.int64(), "rating": pa.float64(),
                              "timestamp": pa.int64()}),
        )
    except pa.ArrowInvalid as exc:
        raise locate_bad_line(path, numbered_lines(path, skip=skip), check, str(exc)) from None
    if table.num_rows == 0:
        raise UserError(f"{path}: empty file (no events)")
    finite = np.isfinite(table.column("rating").to_numpy()).all()
    if any(col.null_count for col in table.columns) or not finite:
        # pyarrow reads "", "NaN", "null" as null in a number column: the checker names the line
        raise locate_bad_line(path, numbered_lines(path, skip=skip), check, "empty or non-finite field")
    times = table.column("timestamp").to_numpy()
    spu = timestamp_scale(times, timestamp_unit, RowLines(path, skip=skip))
    ev = Events(users=table.column("user_id").to_numpy(), items=table.column("item_id").to_numpy(),
                times=times, seconds_per_unit=spu)
    if ratings:
        ev.actions, ev.action_names = rating_actions(path, table.column("rating").to_numpy())
    return build_dataset(ev, src=path, fmt="movielens", name=name or path.parent.name, min_len=min_len,
                         info={"layout": path.name if path.name in FILE_NAMES else layout,
                               "timestamp_unit": unit_of(spu)})

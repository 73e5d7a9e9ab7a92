"""RecBole atomic files: the ``.inter`` file (tab-separated, typed header ``name:type``).

Tokens may be any string (RecBole's Amazon sets use ASIN strings); integer tokens stay integers. Events
are ordered per user by the ``timestamp`` field (file order when the file has none), ties in file order.
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
    TimestampUnit,
    bad_line,
    build_dataset,
    fields_check,
    locate_bad_line,
    numbered_lines,
    rating_actions,
    timestamp_scale,
    unit_of,
)
from grstack.runtime.errors import UserError


def find_inter(src: Path) -> Path:
    if src.is_file():
        return src
    found = sorted(src.glob("*.inter"))
    if len(found) != 1:
        names = ", ".join(f.name for f in found)
        what = f"{len(found)} .inter files ({names})" if found else "no .inter file"
        raise UserError(f"{src}: expected one RecBole .inter file, found {what}")
    return found[0]


def _header(path: Path) -> tuple[list[str], list[str]]:
    with path.open("r", encoding="utf-8-sig", errors="replace") as f:  # -sig: a BOM is not in a name
        first = f.readline().rstrip("\r\n")
    if not first.strip():
        raise UserError(f"{path}: empty file (no header line)")
    names, types = [], []
    for col in first.split("\t"):
        name, sep, typ = col.partition(":")
        if not sep or not name:
            raise bad_line(path, 1, f"header field {col!r} is not of the form name:type")
        names.append(name)
        types.append(typ)
    return names, types


def import_recbole(src: Path, *, min_len: int = DEFAULT_MIN_LEN, name: str | None = None,
                   user_field: str = "user_id", item_field: str = "item_id",
                   time_field: str = "timestamp", ratings: bool = False,
                   rating_field: str = "rating", timestamp_unit: TimestampUnit = "auto") -> SequenceDataset:
    """With ``ratings``, the ``rating_field`` of each event becomes its action bits (:func:`rating_actions`).
    ``timestamp_unit`` is the unit of ``time_field`` ("auto": detected; :func:`timestamp_scale`)."""
    path = find_inter(src)
    names, types = _header(path)
    for required in (user_field, item_field):
        if required not in names:
            raise bad_line(path, 1, f"header has no {required!r} field (fields: {', '.join(names)})")
    has_time = time_field in names
    if not has_time and timestamp_unit != "auto":
        raise bad_line(path, 1, f"--timestamp-unit {timestamp_unit}: the header has no {time_field!r} field "
                                "(events keep file order)")
    if has_time and types[names.index(time_field)] != "float":
        raise bad_line(path, 1, f"field {time_field!r} must have type float")
    if ratings and rating_field not in names:
        raise bad_line(path, 1, f"ratings as actions: the header has no {rating_field!r} field "
                                f"(fields: {', '.join(names)})")
    numbers = ([time_field] if has_time else []) + ([rating_field] if ratings else [])
    used = [user_field, item_field, *numbers]
    check = fields_check("\t", names, numbers=numbers, tokens=[user_field, item_field])
    column_types = {n: pa.string() for n in names} | {n: pa.float64() for n in numbers}
    try:
        table = pa_csv.read_csv(
            path,
            read_options=pa_csv.ReadOptions(skip_rows=1, column_names=names),
            parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pa_csv.ConvertOptions(column_types=column_types, include_columns=used),
        )
    except pa.ArrowInvalid as exc:
        raise locate_bad_line(path, numbered_lines(path, skip=1), check, str(exc)) from None
    if table.num_rows == 0:
        raise UserError(f"{path}: empty file (no events after the header)")
    users, items = table.column(user_field), table.column(item_field)
    bad = pc.any(pc.or_(pc.equal(users, ""), pc.equal(items, ""))).as_py()
    times = table.column(time_field).to_numpy() if has_time else np.arange(table.num_rows, dtype=np.int64)
    if bad or (has_time and table.column(time_field).null_count):  # "", "NA", "null": the checker names them
        raise locate_bad_line(path, numbered_lines(path, skip=1), check, "empty id or timestamp")
    spu = timestamp_scale(times, timestamp_unit, RowLines(path, skip=1), time_field) if has_time else 1.0
    ev = Events(users=users.to_numpy(zero_copy_only=False), items=items.to_numpy(zero_copy_only=False),
                times=times, seconds_per_unit=spu)
    if ratings:
        values = table.column(rating_field).to_numpy()
        if not np.isfinite(values).all():
            raise locate_bad_line(path, numbered_lines(path, skip=1), check, "non-finite rating")
        ev.actions, ev.action_names = rating_actions(path, values)
    return build_dataset(ev, src=path, fmt="recbole", name=name or path.stem, min_len=min_len,
                         info={"time_field": time_field if has_time else None,
                               "timestamp_unit": unit_of(spu) if has_time else None})

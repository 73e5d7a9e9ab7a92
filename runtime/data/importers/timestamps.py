"""Timestamp units: every stored timestamp is int64 Unix seconds (what the Parquet format, the time-bias
buckets and the serving schema, ``ge=0``, all read), so a source in another unit is converted once here.

A source's times must be finite, non-negative and before 2100-01-01 in their unit; the first row that is
not is refused by its line. ``unit="auto"`` detects the unit from the median value, over windows that do
not overlap, so no file is read two ways:

- seconds: median before 2100 (this includes small ordinal times such as positions 0, 1, 2, ...);
- milliseconds / microseconds: median a date from 1973-03-03 (10^8 s) to 2100. Read in these units, every
  value must be such a date: a row far below the rest means the file mixes units.

A median in neither window (10^10: year 2286 in seconds, 1970-04-26 in milliseconds) is refused with a
message asking for ``--timestamp-unit`` rather than guessed.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Protocol

import numpy as np

from grstack.runtime.errors import UserError

PER_SECOND: dict[str, int] = {"s": 1, "ms": 1_000, "us": 1_000_000}
UNIT_NAMES: dict[str, str] = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}
UNITS: tuple[str, ...] = ("auto", *PER_SECOND)
MAX_SECONDS = 4_102_444_800  # 2100-01-01T00:00:00Z, exclusive
DATE_FLOOR_SECONDS = 100_000_000  # 1973-03-03: ms/us values are dates after this, or auto does not pick them
HINT = "pass --timestamp-unit s, ms or us (in a training config: data.timestamp_unit)"


class Rows(Protocol):
    """Where a row came from (:class:`~grstack.runtime.data.importers.common.RowLines`)."""

    @property
    def path(self) -> Path: ...  # read-only: RowLines is a frozen dataclass

    def error(self, row: int, what: str) -> UserError: ...


def check_unit(unit: str) -> str:
    if unit not in UNITS:
        raise UserError(f"unknown timestamp unit {unit!r} (known: {', '.join(UNITS)})")
    return unit


def unit_of(seconds_per_unit: float) -> str:
    """The unit name of a scale :func:`scale` returned (recorded in the dataset's ``info``)."""
    per_second = round(1.0 / seconds_per_unit)
    return next(u for u, f in PER_SECOND.items() if f == per_second)


def show(value: float | int) -> str:
    """A value as the user would recognise it: integers exactly, floats in the shortest exact form."""
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if np.isfinite(value) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def iso(seconds: float) -> str | None:
    """The UTC date of ``seconds`` for a message or a report; None outside years 1..9999 (never raises)."""
    if not np.isfinite(seconds) or not -62_135_596_800 <= seconds < 253_402_300_800:
        return None
    return (dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=int(seconds // 1))).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def detect(median: float) -> str | None:
    """The unit whose window holds ``median`` (module docstring); None when none does."""
    if median < MAX_SECONDS:
        return "s"
    for unit in ("ms", "us"):
        f = PER_SECOND[unit]
        if DATE_FLOOR_SECONDS * f <= median < MAX_SECONDS * f:
            return unit
    return None


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def scale(values: np.ndarray, unit: str, where: Rows, field_name: str = "timestamp") -> float:
    """Seconds per unit of ``values`` (1, 1e-3 or 1e-6) once every value is a valid time in that unit."""
    check_unit(unit)
    v = np.asarray(values)
    if v.size == 0:
        return 1.0 / PER_SECOND.get(unit, 1)
    if v.dtype.kind == "f":
        row = _first(~np.isfinite(v))
        if row is not None:
            raise where.error(row, f"{field_name} must be a finite number, got {show(v[row])}")
    elif v.dtype.kind not in "iu":
        raise UserError(f"{where.path}: {field_name} values must be numbers, not {v.dtype}")
    row = _first(v < 0)
    if row is not None:
        raise where.error(row, f"{field_name} {show(v[row])} is negative: timestamps are Unix times, "
                               "from 1970-01-01 on")
    detected = unit == "auto"
    if detected:
        median = float(np.median(v))
        found = detect(median)
        if found is None:
            readings = ", ".join(f"as {UNIT_NAMES[u]} {iso(median / f) or 'after 9999'}"
                                 for u, f in PER_SECOND.items())
            raise UserError(f"{where.path}: cannot tell the unit of {field_name} from its values (median "
                            f"{show(median)}: {readings}; seconds must fall before 2100, ms and us from 1973 "
                            f"to 2099); {HINT}")
        unit = found
    f = PER_SECOND[unit]
    how = f"read as {UNIT_NAMES[unit]}"
    hint = (f"; {UNIT_NAMES[unit]} were detected from the file's values: if it is in another unit, {HINT}"
            if detected else "")
    row = _first(v >= MAX_SECONDS * f)
    if row is not None:
        date = iso(float(v[row]) / f)
        raise where.error(row, f"{field_name} {show(v[row])} {how} is " + (f"{date}, " if date else "")
                          + f"not before 2100-01-01{hint}")
    if detected and unit != "s":
        row = _first(v < DATE_FLOOR_SECONDS * f)
        if row is not None:
            raise where.error(row, f"{field_name} {show(v[row])} {how} is {iso(float(v[row]) / f)}, "
                                   "years before the rest of the file: does it mix units? "
                                   f"{UNIT_NAMES[unit]} were detected from its values; for one unit per "
                                   f"file, {HINT}")
    return 1.0 / f

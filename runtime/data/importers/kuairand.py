"""KuaiRand logs (``log_standard_*.csv``): every exposure is an event, with its feedback as an action bitmask.

Bits (shared with the synthetic generator for the first three): click, like, long_view, follow, comment,
forward, hate, profile_enter. Timestamps are ``time_ms`` (milliseconds, unless ``timestamp_unit`` says
otherwise) floored to seconds; order uses the milliseconds. Files are streamed with pyarrow.csv, reading only
the columns used.
"""

from __future__ import annotations

import csv
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
    bad_line,
    build_dataset,
    fields_check,
    locate_bad_line,
    numbered_lines,
    timestamp_scale,
)
from grstack.runtime.data.importers.timestamps import PER_SECOND, check_unit
from grstack.runtime.errors import UserError

# action name -> KuaiRand column; the bit of an action is its position here.
ACTIONS: dict[str, str] = {
    "click": "is_click",
    "like": "is_like",
    "long_view": "long_view",
    "follow": "is_follow",
    "comment": "is_comment",
    "forward": "is_forward",
    "hate": "is_hate",
    "profile_enter": "is_profile_enter",
}
REQUIRED = ("user_id", "video_id", "time_ms")
PATTERN = "log_standard_*.csv"
BLOCK_SIZE = 64 << 20  # bytes per streamed batch


def find_logs(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    found = sorted(src.glob(PATTERN))
    if not found:
        raise UserError(f"{src}: no KuaiRand {PATTERN} files")
    return found


def _header(path: Path) -> list[str]:
    with path.open("r", encoding="utf-8-sig", errors="replace") as f:  # -sig: a BOM is not in a name
        first = f.readline().rstrip("\r\n")
    if not first.strip():
        raise UserError(f"{path}: empty file (no header line)")
    try:
        names = [n.strip() for n in next(csv.reader([first], strict=True))]
    except csv.Error as exc:
        raise bad_line(path, 1, f"malformed quoting in the header ({exc})") from None
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise bad_line(path, 1, f"header lacks column(s) {', '.join(missing)}")
    return names


def _read_one(path: Path, clicks_only: bool, unit: str) -> tuple[list[np.ndarray], list[str]]:
    names = _header(path)
    flags = {a: c for a, c in ACTIONS.items() if c in names}
    used = list(REQUIRED) + list(flags.values())
    check = fields_check(",", names, ints=used, quoted=True)
    users, items, times, actions = [], [], [], []
    rows = 0
    try:
        reader = pa_csv.open_csv(
            path,
            read_options=pa_csv.ReadOptions(block_size=BLOCK_SIZE, skip_rows=1, column_names=names),
            parse_options=pa_csv.ParseOptions(),
            convert_options=pa_csv.ConvertOptions(column_types={c: pa.int64() for c in used},
                                                  include_columns=used),
        )
        for batch in reader:
            stamps = batch.column("time_ms").to_numpy()
            timestamp_scale(stamps, unit, RowLines(path, skip=1, first_row=rows), "time_ms")
            rows += batch.num_rows
            mask = np.zeros(batch.num_rows, dtype=np.int64)
            for bit, (action, col) in enumerate(ACTIONS.items()):
                if action in flags:
                    mask |= (batch.column(col).to_numpy() != 0).astype(np.int64) << bit
            keep = (mask & 1).astype(bool) if clicks_only else slice(None)
            users.append(batch.column("user_id").to_numpy()[keep])
            items.append(batch.column("video_id").to_numpy()[keep])
            times.append(stamps[keep])
            actions.append(mask[keep])
    except pa.ArrowInvalid as exc:
        raise locate_bad_line(path, numbered_lines(path, skip=1), check, str(exc)) from None
    if rows == 0:
        raise UserError(f"{path}: empty file (no events after the header)")
    arrays = [np.concatenate(x) if x else np.zeros(0, np.int64) for x in (users, items, times, actions)]
    return arrays, list(flags)


def import_kuairand(src: Path, *, min_len: int = DEFAULT_MIN_LEN, name: str | None = None,
                    clicks_only: bool = False, timestamp_unit: TimestampUnit = "auto") -> SequenceDataset:
    """``timestamp_unit`` "auto" is milliseconds, the unit of KuaiRand's ``time_ms``."""
    unit = "ms" if check_unit(timestamp_unit) == "auto" else timestamp_unit
    files = find_logs(src)
    parts, present = [], set()
    for path in files:
        arrays, flags = _read_one(path, clicks_only, unit)
        parts.append(arrays)
        present.update(flags)
    users, items, times, actions = (np.concatenate(col) for col in zip(*parts, strict=True))
    # Keep bits stable across datasets: drop only trailing actions that no file has.
    names = list(ACTIONS)
    while names and names[-1] not in present:
        names.pop()
    ev = Events(users=users, items=items, times=times, seconds_per_unit=1.0 / PER_SECOND[unit],
                actions=actions, action_names=names)
    return build_dataset(ev, src=src, fmt="kuairand", name=name, min_len=min_len,
                         info={"files": [f.name for f in files], "clicks_only": clicks_only,
                               "timestamp_unit": unit,
                               "missing_actions": [a for a in names if a not in present]})

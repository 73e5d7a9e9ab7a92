"""S3-Rec style text: one user per line, ``user item_1 item_2 ...`` (whitespace-separated integers).

Items are already in time order and there are no timestamps, so positions 0..L-1 serve as timestamps.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.importers.common import (
    DEFAULT_MIN_LEN,
    Events,
    TimestampUnit,
    bad_line,
    build_dataset,
    int_problem,
    is_int,
)
from grstack.runtime.errors import UserError

_ONLY_INTS = re.compile(rb"^[0-9 \t\r\n-]*$")
_NOT_ALLOWED = re.compile(r"[^0-9 \t\r-]")


_NOT_DATA = ("source", "readme", "license")


def find_txt(src: Path) -> Path:
    """The file itself, or the one ``*.txt`` in a directory that is neither documentation nor S3-Rec's
    ``*_sample.txt`` negatives (same layout, different meaning)."""
    if src.is_file():
        return src
    found = sorted(f for f in src.glob("*.txt")
                   if not f.name.lower().startswith(_NOT_DATA) and not f.stem.endswith("_sample"))
    if len(found) != 1:
        names = ", ".join(f.name for f in found)
        what = f"{len(found)} .txt files ({names})" if found else "no .txt file"
        raise UserError(f"{src}: expected one sequence .txt file, found {what}")
    return found[0]


def _first_bad(path: Path, lines: list[str]) -> UserError:
    for lineno, line in enumerate(lines, start=1):
        for tok in line.split():
            if not is_int(tok):
                return bad_line(path, lineno, f"ids must be integers, got {tok!r}")
            problem = int_problem("id", tok)
            if problem:
                return bad_line(path, lineno, problem)
        odd = _NOT_ALLOWED.search(line)
        if odd:
            return bad_line(path, lineno, f"unexpected character {odd.group()!r} (ids are integers separated "
                                          "by spaces or tabs)")
    return UserError(f"{path}: not a 'user item item ...' text file")


def import_seqtxt(src: Path, *, min_len: int = DEFAULT_MIN_LEN, name: str | None = None,
                  timestamp_unit: TimestampUnit = "auto") -> SequenceDataset:
    """``timestamp_unit`` must stay "auto": the file has no times (positions are used)."""
    if timestamp_unit != "auto":
        raise UserError(f"--timestamp-unit {timestamp_unit}: seqtxt files have no timestamps "
                        "(events are numbered 0..L-1 in file order)")
    path = find_txt(src)
    data = path.read_bytes()
    if not data.strip():
        raise UserError(f"{path}: empty file (no events)")
    text = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")  # not splitlines(): "\x0b" or "\x1c" ends no line in an editor
    rows = [line.split() for line in lines]
    if not _ONLY_INTS.match(data):
        raise _first_bad(path, lines)
    lineno = np.array([i + 1 for i, r in enumerate(rows) if r], dtype=np.int64)
    counts = np.array([len(r) for r in rows if r], dtype=np.int64)
    try:
        flat = np.array([tok for r in rows for tok in r], dtype=np.int64)
    except (ValueError, OverflowError):
        raise _first_bad(path, lines) from None
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    users = flat[starts]
    uniq, first, inverse = np.unique(users, return_index=True, return_inverse=True)
    if len(uniq) != len(users):
        dup = int(np.flatnonzero(first[inverse] != np.arange(len(users)))[0])
        earlier = int(lineno[first[inverse[dup]]])
        raise bad_line(path, int(lineno[dup]), f"user {users[dup]} already appeared on line {earlier}")
    n_items = counts - 1
    is_item = np.ones(len(flat), dtype=bool)
    is_item[starts] = False
    item_start = np.repeat(np.cumsum(n_items) - n_items, n_items)
    ev = Events(users=np.repeat(users, n_items), items=flat[is_item],
                times=np.arange(int(n_items.sum()), dtype=np.int64) - item_start)
    return build_dataset(ev, src=path, fmt="seqtxt", name=name or path.stem, min_len=min_len,
                         info={"timestamps": "ordinal positions 0..L-1 (the file has no times)"})

"""What every importer shares: raw events -> time-ordered, dense-id ``SequenceDataset``; line-exact errors.

Importers parse fast (pyarrow.csv or one vectorised pass). Only when that fails do they re-read the file
line by line with a strict checker, so a bad file is reported as ``FILE, line N: what is wrong`` while a
good file never pays for Python-level parsing.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.importers.timestamps import UNITS, scale
from grstack.runtime.data.importers.timestamps import unit_of as unit_of  # re-exported for importers
from grstack.runtime.errors import UserError

DEFAULT_MIN_LEN = 3  # leave-one-out needs a train, a validation and a test item per user

_INT_RE = re.compile(r"-?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")

LineCheck = Callable[[str], "str | None"]

TimestampUnit = Literal["auto", "s", "ms", "us"]
TIMESTAMP_UNITS: tuple[str, ...] = UNITS  # for --timestamp-unit choices


@dataclass
class Events:
    """One source's events in file order. Ids may be int64 or strings; ``times`` is the sort key."""

    users: np.ndarray
    items: np.ndarray
    times: np.ndarray  # int64 or float64, in units of ``seconds_per_unit`` seconds (:func:`timestamp_scale`)
    seconds_per_unit: float = 1.0
    actions: np.ndarray | None = None
    action_names: list[str] = field(default_factory=list)


MAX_RATING_LEVELS = 16  # actions are an int64 bitmask; a rating scale wider than this is not a scale


def rating_actions(path: Path | str, ratings: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Ratings as action bits, one per rating level present in the file (``rating_1`` … ``rating_5`` on
    MovieLens; ``rating_0p5`` for half stars): each event sets exactly the bit of its own rating, so a model
    with ``model.action_inputs`` embeds the rating value, and nothing about its order is assumed."""
    levels = np.unique(ratings)
    if len(levels) > MAX_RATING_LEVELS:
        raise UserError(f"{path}: the rating field has {len(levels)} distinct values; ratings become one action "
                        f"bit per level, at most {MAX_RATING_LEVELS} (is it a rating?)")
    bits = np.searchsorted(levels, ratings)
    names = ["rating_" + f"{float(v):g}".replace(".", "p").replace("-", "m") for v in levels]
    return (np.int64(1) << bits.astype(np.int64)), names


def bad_line(path: Path | str, lineno: int, what: str) -> UserError:
    return UserError(f"{path}, line {lineno}: {what}")


def is_int(token: str) -> bool:
    return _INT_RE.fullmatch(token) is not None


INT64_MAX = np.iinfo(np.int64).max


def int_problem(name: str, token: str) -> str | None:
    """Why ``token`` is not an int64 field value (spaces around it allowed, as pyarrow does), or None."""
    if not is_int(token.strip(" ")):
        return f"{name} must be an integer, got {token!r}"
    if not -INT64_MAX - 1 <= int(token) <= INT64_MAX:
        return f"{name} {token.strip(' ')} does not fit in 64 bits (at most {INT64_MAX})"
    return None


def is_number(token: str) -> bool:
    """A finite decimal number (Python's float() also takes "1_000", which pyarrow refuses)."""
    token = token.strip(" ")
    return _FLOAT_RE.fullmatch(token) is not None and bool(np.isfinite(float(token)))


def check_missing(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")


def numbered_lines(path: Path, skip: int = 0) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline), skipping the first ``skip`` lines and empty lines
    (as pyarrow.csv does: a line of only tabs or spaces is a row, with empty fields, so it is checked)."""
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        for lineno, line in enumerate(f, start=1):
            if lineno <= skip:
                continue
            line = line.rstrip("\r\n")
            if line:
                yield lineno, line


def locate_bad_line(path: Path, lines: Iterable[tuple[int, str]], check: LineCheck,
                    fallback: str) -> UserError:
    """The error for the first line ``check`` rejects; ``fallback`` (the fast parser's message) if none."""
    for lineno, line in lines:
        problem = check(line)
        if problem:
            return bad_line(path, lineno, problem)
    return UserError(f"{path}: {fallback.splitlines()[0] if fallback else 'unreadable'}")


def fields_check(delimiter: str, names: list[str], ints: Iterable[str] = (), numbers: Iterable[str] = (),
                 tokens: Iterable[str] = (), quoted: bool = False, unquote: bool = False) -> LineCheck:
    """A line checker for delimited rows: field count, int64 integers, finite numbers, non-empty tokens.
    ``quoted`` (or its older name ``unquote``) splits as CSV does (``"11,5"`` is one field), for files that
    pyarrow reads with quoting."""
    quoted = quoted or unquote
    idx = {n: i for i, n in enumerate(names)}
    int_idx = [idx[n] for n in ints]
    checks = ([(idx[n], "a finite number", is_number) for n in numbers]
              + [(idx[n], "a non-empty token", bool) for n in tokens])
    label = "tab" if delimiter == "\t" else repr(delimiter)

    def check(line: str) -> str | None:
        if quoted:
            try:
                parts = next(csv.reader([line], delimiter=delimiter, strict=True))
            except csv.Error as exc:
                return f"malformed quoting ({exc})"
        else:
            parts = line.split(delimiter)
        if len(parts) != len(names):
            return f"expected {len(names)} {label}-separated fields, got {len(parts)}"
        for i in int_idx:
            problem = int_problem(names[i], parts[i])
            if problem:
                return problem
        for i, kind, ok in checks:
            if not ok(parts[i]):
                return f"{names[i]} must be {kind}, got {parts[i]!r}"
        return None

    return check


@dataclass(frozen=True)
class RowLines:
    """Where row ``i`` of a parsed table came from: the ``first_row + i``-th non-empty line after ``skip``
    header lines (pyarrow.csv and :func:`numbered_lines` both skip empty lines), found only on error."""

    path: Path
    skip: int = 0
    first_row: int = 0

    def line(self, row: int) -> int:
        target = self.first_row + row
        for k, (lineno, _) in enumerate(numbered_lines(self.path, skip=self.skip)):
            if k == target:
                return lineno
        return self.skip + target + 1  # unreachable for a table read from this file

    def error(self, row: int, what: str) -> UserError:
        return bad_line(self.path, self.line(row), what)


def timestamp_scale(values: np.ndarray, unit: str, where: RowLines | Path | str,
                    field_name: str = "timestamp") -> float:
    """Seconds per unit of ``values`` (``Events.seconds_per_unit``), after checking every value is a valid
    time in ``unit`` ("auto": detected; :mod:`.timestamps`). A bad row is refused by its line: ``where`` is
    the file's :class:`RowLines` (a bare path means row i is the file's i-th non-empty line)."""
    rows = where if isinstance(where, RowLines) else RowLines(Path(where))
    return scale(values, unit, rows, field_name)


def to_seconds(values: np.ndarray, unit: str, where: RowLines | Path | str,
               field_name: str = "timestamp") -> np.ndarray:
    """``values`` checked (:func:`timestamp_scale`) and floored to int64 Unix seconds, the stored unit."""
    return _to_seconds(values, timestamp_scale(values, unit, where, field_name))


def _dense(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique raw ids, dense index 0..n-1 per entry); numeric order for ints, else lexicographic."""
    uniq, inverse = np.unique(raw, return_inverse=True)
    return uniq, inverse.reshape(-1).astype(np.int64)


def _as_ids(raw: np.ndarray) -> np.ndarray:
    """Integer-valued string tokens become int64 (if that is lossless: "07" and "7" stay distinct)."""
    if raw.dtype.kind in "iu":
        return raw.astype(np.int64)
    tokens = raw.astype(str)
    uniq = np.unique(tokens)
    if all(is_int(t) and (t == "0" or not t.lstrip("-").startswith("0")) for t in uniq):
        try:
            return tokens.astype(np.int64)
        except OverflowError:  # wider than int64: keep them as tokens
            pass
    return tokens


def _to_seconds(times: np.ndarray, seconds_per_unit: float) -> np.ndarray:
    """Floored int64 seconds. Dividing by the integer count per second is exact where multiplying by
    ``seconds_per_unit`` is not (1649376001000 * 0.001 < 1649376001)."""
    per_second = round(1.0 / seconds_per_unit)
    if times.dtype.kind in "iu":
        return np.floor_divide(times.astype(np.int64), per_second)
    return np.floor(times.astype(np.float64) / per_second).astype(np.int64)


def build_dataset(ev: Events, *, src: Path, fmt: str, name: str | None, min_len: int,
                  info: dict | None = None) -> SequenceDataset:
    """Stable time order per user (ties keep file order), min-length filter, dense item ids 1..N.

    Users are ordered by id. Integer user ids are kept; other user tokens get dense ids 1..U (sorted) and
    the tokens are kept in ``user_raw_ids``. Item ids are dense in order of their raw id, and the raw ids
    are kept in ``item_raw_ids`` (written to ``items.parquet``).
    """
    if min_len < 1:
        raise UserError(f"--min-len must be at least 1, got {min_len}")
    n_raw = len(ev.items)
    if n_raw == 0:
        raise UserError(f"{src}: empty file (no events)")
    users = _as_ids(ev.users)
    user_raw = None
    if users.dtype.kind not in "iu":
        user_raw, users = _dense(users)
        users = users + 1
    order = np.argsort(ev.times, kind="stable")
    order = order[np.argsort(users[order], kind="stable")]
    users = users[order]
    starts = np.concatenate([[0], np.flatnonzero(users[1:] != users[:-1]) + 1])
    counts = np.diff(np.append(starts, len(users)))
    uniq_users = users[starts]
    keep_user = counts >= min_len
    keep = np.repeat(keep_user, counts)
    if not keep.any():
        raise UserError(f"{src}: no user has at least {min_len} events (--min-len {min_len})")
    order = order[keep]
    item_raw, items = _dense(_as_ids(ev.items)[order])
    lengths = counts[keep_user]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    meta = {"format": fmt, "min_len": min_len, "raw_users": len(uniq_users), "raw_events": n_raw,
            "dropped_users": int((~keep_user).sum()), "dropped_events": int(n_raw - len(order))}
    ds = SequenceDataset(
        user_ids=uniq_users[keep_user].astype(np.int64),
        offsets=offsets,
        item_ids=items + 1,
        timestamps=_to_seconds(ev.times[order], ev.seconds_per_unit),
        num_items=len(item_raw),
        actions=ev.actions[order].astype(np.int64) if ev.actions is not None else None,
        action_names=list(ev.action_names),
        name=name or (src.stem if src.is_file() else src.name),
        source=f"{fmt}:{src}",
        item_raw_ids=item_raw,
        user_raw_ids=user_raw[uniq_users[keep_user] - 1] if user_raw is not None else None,
        info={**meta, **(info or {})},
    )
    ds.validate()
    return ds

"""The on-disk sequence format and its in-memory form.

A dataset directory holds ``meta.json`` and one or more ``part-*.parquet`` files with one row per user:
``user_id: int64``, ``item_ids: list<int64>``, ``timestamps: list<int64>`` and optionally
``actions: list<int64>`` (a bitmask per event; bit names in ``meta.json``). Item ids are dense in
``1..num_items``; 0 is reserved for padding. Rows are time-ordered (stable on ties).

Imported datasets also carry ``items.parquet`` (``item_id`` dense -> ``raw_id`` as in the source, int64 or
string) so serving can translate ids, and ``users.parquet`` when raw user ids were not integers.
``meta.json`` has an ``info`` object with provenance (importer options, filters, generator preset).
Optional categorical side features of items and users (``data/features.py``) sit beside them:
``item_features.parquet``, ``user_features.parquet`` and their ``features_vocab.parquet``.

In memory a dataset is jagged: flat value arrays plus ``offsets`` (length ``num_users + 1``), so nothing
is padded.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from grstack.runtime.data.features import Features, read_features, write_features
from grstack.runtime.errors import UserError

FORMAT_VERSION = 1
META_FILE = "meta.json"
ITEMS_FILE = "items.parquet"
USERS_FILE = "users.parquet"

SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("item_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("timestamps", pa.list_(pa.int64()), nullable=False),
        pa.field("actions", pa.list_(pa.int64()), nullable=True),
    ]
)


@dataclass
class SequenceDataset:
    """All users' sequences as jagged numpy arrays."""

    user_ids: np.ndarray  # [U] int64
    offsets: np.ndarray  # [U + 1] int64
    item_ids: np.ndarray  # [T] int64, in 1..num_items
    timestamps: np.ndarray  # [T] int64
    num_items: int
    actions: np.ndarray | None = None  # [T] int64 bitmask
    action_names: list[str] = field(default_factory=list)
    name: str = "dataset"
    source: str = ""
    item_raw_ids: np.ndarray | None = None  # [num_items]; entry k-1 is the source id of dense item k
    user_raw_ids: np.ndarray | None = None  # [U]; source ids when they were not integers
    info: dict = field(default_factory=dict)  # provenance, written to meta.json
    item_features: Features | None = None  # rows: items 1..num_items
    user_features: Features | None = None  # rows: users in dataset order

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_events(self) -> int:
        return int(self.offsets[-1])

    def sequence(self, u: int) -> np.ndarray:
        return self.item_ids[self.offsets[u] : self.offsets[u + 1]]

    def validate(self) -> None:
        """Checks the invariants every consumer relies on; raises UserError naming the broken one."""
        if len(self.offsets) != self.num_users + 1 or self.offsets[0] != 0:
            raise UserError(f"dataset {self.name}: offsets do not match {self.num_users} users")
        if np.any(np.diff(self.offsets) < 0):
            raise UserError(f"dataset {self.name}: offsets are not non-decreasing")
        n = self.num_events
        if len(self.item_ids) != n or len(self.timestamps) != n:
            raise UserError(f"dataset {self.name}: value arrays do not match offsets ({n} events)")
        if self.actions is not None and len(self.actions) != n:
            raise UserError(f"dataset {self.name}: actions do not match offsets ({n} events)")
        if n and (self.item_ids.min() < 1 or self.item_ids.max() > self.num_items):
            raise UserError(f"dataset {self.name}: item ids must lie in 1..{self.num_items}")
        if self.num_users == 0 or n == 0:
            raise UserError(f"dataset {self.name}: no users or no events")
        back = np.flatnonzero(np.diff(self.timestamps) < 0)
        if back.size:
            # A step backwards in time is only allowed where one user's sequence ends and the next begins.
            starts = self.offsets[1:-1]
            back = back[~np.isin(back + 1, starts)]
            if back.size:
                u = int(np.searchsorted(self.offsets, back[0], side="right") - 1)
                raise UserError(f"dataset {self.name}: timestamps of user {self.user_ids[u]} "
                                "are not time-ordered")
        if self.item_raw_ids is not None and len(self.item_raw_ids) != self.num_items:
            raise UserError(f"dataset {self.name}: item id map has {len(self.item_raw_ids)} entries, "
                            f"expected {self.num_items}")
        if self.user_raw_ids is not None and len(self.user_raw_ids) != self.num_users:
            raise UserError(f"dataset {self.name}: user id map has {len(self.user_raw_ids)} entries, "
                            f"expected {self.num_users}")
        for feats, rows in ((self.item_features, self.num_items), (self.user_features, self.num_users)):
            if feats is not None:
                if feats.num_rows != rows:
                    raise UserError(f"dataset {self.name}: {feats.kind} features cover {feats.num_rows} rows, "
                                    f"expected {rows}")
                feats.validate(f"dataset {self.name}")


def from_sequences(
    users: list[int],
    items: list[np.ndarray],
    timestamps: list[np.ndarray],
    num_items: int,
    actions: list[np.ndarray] | None = None,
    **meta: object,
) -> SequenceDataset:
    """Builds a dataset from per-user arrays (already time-ordered, ids already dense)."""
    lengths = np.array([len(s) for s in items], dtype=np.int64)
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    ds = SequenceDataset(
        user_ids=np.asarray(users, dtype=np.int64),
        offsets=offsets,
        item_ids=cat(items),
        timestamps=cat(timestamps),
        num_items=int(num_items),
        actions=cat(actions) if actions is not None else None,
        **meta,  # type: ignore[arg-type]
    )
    ds.validate()
    return ds


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
    if offsets[-1] >= 2**31:
        raise ValueError("a part file holds more than 2**31 events; lower rows_per_file")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=pa.int64()))


def _id_map_table(key: str, ids: np.ndarray, raw: np.ndarray) -> pa.Table:
    raw_arr = pa.array(raw, type=pa.int64()) if raw.dtype.kind in "iu" else pa.array(raw.astype(str))
    return pa.table({key: pa.array(ids, type=pa.int64()), "raw_id": raw_arr})


def _part_bounds(offsets: np.ndarray, rows_per_file: int, events_per_file: int) -> list[tuple[int, int]]:
    """User ranges of the part files: at most ``rows_per_file`` users and, unless one user alone is longer,
    at most ``events_per_file`` events each, so ranks can split a large set by file."""
    bounds, start, n_users = [], 0, len(offsets) - 1
    while start < n_users:
        by_events = int(np.searchsorted(offsets, offsets[start] + events_per_file, side="right")) - 1
        stop = min(start + rows_per_file, max(by_events, start + 1), n_users)
        bounds.append((start, stop))
        start = stop
    return bounds


def write_dataset(ds: SequenceDataset, out_dir: str | os.PathLike, rows_per_file: int = 50_000,
                  row_group_size: int = 4096, events_per_file: int = 2_000_000) -> Path:
    """Writes atomically: a temporary sibling directory is renamed into place, so a failure leaves nothing."""
    ds.validate()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output directory {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()  # not tempfile.mkdtemp: that makes the directory private (0700) instead of following umask
    try:
        for part, (start, stop) in enumerate(_part_bounds(ds.offsets, rows_per_file, events_per_file)):
            lo, hi = ds.offsets[start], ds.offsets[stop]
            offs = ds.offsets[start : stop + 1] - lo
            cols = {
                "user_id": pa.array(ds.user_ids[start:stop], type=pa.int64()),
                "item_ids": _list_array(ds.item_ids[lo:hi], offs),
                "timestamps": _list_array(ds.timestamps[lo:hi], offs),
                "actions": (_list_array(ds.actions[lo:hi], offs) if ds.actions is not None
                            else pa.nulls(stop - start, type=pa.list_(pa.int64()))),
            }
            table = pa.Table.from_pydict(cols, schema=SCHEMA)
            pq.write_table(table, tmp / f"part-{part:05d}.parquet", row_group_size=row_group_size)
        if ds.item_raw_ids is not None:
            dense = np.arange(1, ds.num_items + 1, dtype=np.int64)
            pq.write_table(_id_map_table("item_id", dense, ds.item_raw_ids), tmp / ITEMS_FILE)
        if ds.user_raw_ids is not None:
            pq.write_table(_id_map_table("user_id", ds.user_ids, ds.user_raw_ids), tmp / USERS_FILE)
        meta = {
            "format_version": FORMAT_VERSION,
            "name": ds.name,
            "source": ds.source,
            "num_users": ds.num_users,
            "num_items": ds.num_items,
            "num_events": ds.num_events,
            "has_actions": ds.actions is not None,
            "action_names": ds.action_names,
            "item_map": ITEMS_FILE if ds.item_raw_ids is not None else None,
            "user_map": USERS_FILE if ds.user_raw_ids is not None else None,
            "info": ds.info,
        }
        feats = {f.kind: f for f in (ds.item_features, ds.user_features) if f is not None}
        meta.update(write_features(tmp, feats, {"item": np.arange(1, ds.num_items + 1, dtype=np.int64),
                                                "user": ds.user_ids}))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_meta(path: str | os.PathLike) -> dict:
    p = Path(path)
    meta_path = p / META_FILE
    if not p.is_dir():
        raise UserError(f"dataset directory {p} does not exist")
    if not meta_path.is_file():
        raise UserError(f"{p} is not a grstack dataset: {META_FILE} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{meta_path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    for key in ("num_items", "num_users"):
        if not isinstance(meta.get(key), int):
            raise UserError(f"{meta_path}: field {key!r} missing or not an integer")
    return meta


def _read_id_map(path: Path, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, raw ids) from an ``items.parquet``/``users.parquet`` file."""
    try:
        t = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({exc})") from None
    if {key, "raw_id"} - set(t.column_names):
        raise UserError(f"{path}: expected columns {key!r} and 'raw_id'")
    raw = t.column("raw_id").to_numpy(zero_copy_only=False)
    raw = raw.astype(str) if raw.dtype == object else raw.astype(np.int64)
    return t.column(key).to_numpy().astype(np.int64), raw


def _item_map(p: Path, meta: dict) -> np.ndarray | None:
    if not meta.get("item_map"):
        return None
    ids, raw = _read_id_map(p / meta["item_map"], "item_id")
    if not np.array_equal(ids, np.arange(1, len(ids) + 1)):
        raise UserError(f"{p / meta['item_map']}: item_id must be 1..{len(ids)} in order")
    return raw


def _user_map(p: Path, meta: dict, user_ids: np.ndarray) -> np.ndarray | None:
    if not meta.get("user_map"):
        return None
    ids, raw = _read_id_map(p / meta["user_map"], "user_id")
    order = np.argsort(ids, kind="stable")
    pos = np.minimum(np.searchsorted(ids, user_ids, sorter=order), len(ids) - 1)
    if len(ids) == 0 or not np.array_equal(ids[order[pos]], user_ids):
        raise UserError(f"{p / meta['user_map']}: does not cover every user_id of the dataset")
    return raw[order[pos]]


def read_item_map(path: str | os.PathLike) -> np.ndarray | None:
    """Source item ids indexed by ``dense_id - 1`` (None for data without a map, e.g. synthetic)."""
    p = Path(path)
    return _item_map(p, read_meta(p))


def _check_types(path: Path, schema: pa.Schema) -> None:
    """Columns must hold integers (lists of integers for the per-event ones), whatever their width."""
    for f in schema:
        if f.name not in SCHEMA.names:
            continue
        want_list = f.name != "user_id"
        is_list = pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
        inner = f.type.value_type if is_list else f.type
        if want_list != is_list or not (pa.types.is_integer(inner) or pa.types.is_null(inner)):
            expected = SCHEMA.field(f.name).type
            raise UserError(f"{path}: column {f.name!r} has type {f.type}, expected {expected}")


def read_dataset(path: str | os.PathLike, files: list[str] | None = None) -> SequenceDataset:
    """Reads a dataset directory (optionally only some part files, e.g. one rank's share)."""
    p = Path(path)
    meta = read_meta(p)
    names = files if files is not None else sorted(f.name for f in p.glob("part-*.parquet"))
    if not names:
        raise UserError(f"dataset {p} has no part-*.parquet files")
    tables = []
    for name in names:
        if not (p / name).is_file():
            raise UserError(f"{p / name}: not a file (a dataset's part-*.parquet are Parquet files)")
        try:
            t = pq.read_table(p / name)
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{p / name}: not a readable Parquet file ({exc})") from None
        missing = {"user_id", "item_ids", "timestamps"} - set(t.column_names)
        if missing:
            raise UserError(f"{p / name}: missing column(s) {sorted(missing)}")
        _check_types(p / name, t.schema)
        tables.append(t)
    table = pa.concat_tables(tables, promote_options="default")
    items_col = table.column("item_ids").combine_chunks()
    ts_col = table.column("timestamps").combine_chunks()
    offsets = np.asarray(items_col.offsets, dtype=np.int64)
    offsets = offsets - offsets[0]
    item_ids = np.asarray(items_col.flatten(), dtype=np.int64)
    timestamps = np.asarray(ts_col.flatten(), dtype=np.int64)
    if not np.array_equal(np.asarray(ts_col.offsets, dtype=np.int64) - ts_col.offsets[0].as_py(), offsets):
        raise UserError(f"dataset {p}: item_ids and timestamps have different lengths in some row")
    actions = None
    if meta.get("has_actions") and "actions" in table.column_names:
        act_col = table.column("actions").combine_chunks()
        actions = np.asarray(act_col.flatten(), dtype=np.int64)
    user_ids = np.asarray(table.column("user_id"), dtype=np.int64)
    ds = SequenceDataset(
        user_ids=user_ids,
        offsets=offsets,
        item_ids=item_ids,
        timestamps=timestamps,
        num_items=int(meta["num_items"]),
        actions=actions,
        action_names=list(meta.get("action_names", [])),
        name=str(meta.get("name", p.name)),
        source=str(meta.get("source", "")),
        item_raw_ids=_item_map(p, meta),
        user_raw_ids=_user_map(p, meta, user_ids),
        info=dict(meta.get("info") or {}),
        item_features=read_features(p, meta, "item", np.arange(1, int(meta["num_items"]) + 1, dtype=np.int64)),
        user_features=read_features(p, meta, "user", user_ids),
    )
    ds.validate()
    return ds

"""Categorical side features of items (categories, brands, genres, tags) and users (age, gender, ...).

A dataset may carry per-item and per-user features: named fields, each multi-valued (a row holds zero or
more values; single-valued fields are the one-value case). Values are dense ids ``1..num_values`` per
field (0 is never a value); the source's raw tokens are kept as the field's ``vocab`` (entry ``v - 1`` is
value ``v``'s token). Rows are the dataset's dense items ``1..num_items`` (row ``k - 1`` is item ``k``) or
its users in dataset order.

On disk (written beside the part files, named in ``meta.json``): ``item_features.parquet`` (``item_id``
plus one ``list<int64>`` column per field), ``user_features.parquet`` (``user_id`` plus the fields) and
``features_vocab.parquet`` (``kind``, ``field``, ``value_id``, ``raw``).

Importers read side files into :class:`RawFeatures` (keyed by the source's raw ids, values as raw tokens);
:func:`attach` matches them to a dataset's raw ids and makes the values dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from grstack.runtime.errors import UserError

Kind = Literal["item", "user"]
FILES = {"item": "item_features.parquet", "user": "user_features.parquet"}
KEYS = {"item": "item_id", "user": "user_id"}
VOCAB_FILE = "features_vocab.parquet"


@dataclass
class FeatureField:
    """One field: a CSR over rows (``offsets`` [rows + 1], ``values`` dense ids in ``1..len(vocab)``)."""

    name: str
    offsets: np.ndarray
    values: np.ndarray
    vocab: np.ndarray  # raw tokens (str) of values 1..num_values

    @property
    def num_values(self) -> int:
        return len(self.vocab)

    def row(self, r: int) -> np.ndarray:
        return self.values[self.offsets[r] : self.offsets[r + 1]]


@dataclass
class Features:
    """Every field of one kind (items or users) over ``num_rows`` rows."""

    kind: Kind
    num_rows: int
    fields: list[FeatureField] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    @property
    def sizes(self) -> dict[str, int]:
        """``{field: num_values}``: what a model's feature tables are sized by."""
        return {f.name: f.num_values for f in self.fields}

    def select(self, names: list[str], setting: str) -> Features:
        """The named fields in the given order; an unknown name is a UserError naming ``setting``."""
        have = {f.name: f for f in self.fields}
        missing = [n for n in names if n not in have]
        if missing:
            known = ", ".join(self.names) or "none"
            raise UserError(f"{setting}: the dataset has no {self.kind} feature(s) {', '.join(missing)} "
                            f"(its {self.kind} features: {known})")
        return Features(self.kind, self.num_rows, [have[n] for n in names])

    def take_rows(self, rows: np.ndarray) -> Features:
        """The features of rows ``rows`` (in that order), e.g. the users of one part file."""
        out = []
        for f in self.fields:
            starts, ends = f.offsets[rows], f.offsets[rows + 1]
            counts = ends - starts
            offs = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(counts, out=offs[1:])
            idx = np.repeat(starts - offs[:-1], counts) + np.arange(int(offs[-1]))
            out.append(FeatureField(f.name, offs, f.values[idx], f.vocab))
        return Features(self.kind, len(rows), out)

    def padded(self) -> np.ndarray:
        """[num_rows, fields, W] value ids, each field's values first and 0 after (W: the most values any row
        has in one field, at least 1): the fixed-width form batches carry (``JaggedBatch.context``)."""
        width = max([1] + [int(np.diff(f.offsets).max()) for f in self.fields if self.num_rows])
        out = np.zeros((self.num_rows, len(self.fields), width), dtype=np.int64)
        for c, f in enumerate(self.fields):
            counts = np.diff(f.offsets)
            row = np.repeat(np.arange(self.num_rows), counts)
            slot = np.arange(len(f.values)) - np.repeat(f.offsets[:-1], counts)
            out[row, c, slot] = f.values
        return out

    def validate(self, where: str) -> None:
        for f in self.fields:
            if len(f.offsets) != self.num_rows + 1 or f.offsets[0] != 0 or np.any(np.diff(f.offsets) < 0):
                raise UserError(f"{where}: {self.kind} feature {f.name!r} does not cover {self.num_rows} rows")
            if len(f.values) != f.offsets[-1]:
                raise UserError(f"{where}: {self.kind} feature {f.name!r}: values do not match offsets")
            if len(f.values) and (f.values.min() < 1 or f.values.max() > f.num_values):
                raise UserError(f"{where}: {self.kind} feature {f.name!r}: values must lie in 1..{f.num_values}")


@dataclass
class RawFeatures:
    """Features as a side file gives them: rows keyed by raw ids, values as raw tokens.

    ``keys`` [R] (int64 or str, unique); per field a CSR (``offsets`` [R + 1], ``tokens`` [nnz] str).
    ``source`` names the file for error messages.
    """

    kind: Kind
    keys: np.ndarray
    fields: dict[str, tuple[np.ndarray, np.ndarray]]
    source: str


def csr_from_lists(rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, tokens) of per-row token lists."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    tokens = np.array([t for r in rows for t in r], dtype=str) if offsets[-1] else np.zeros(0, dtype=str)
    return offsets, tokens


def _normalise_keys(keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides as comparable arrays: integers when both are integers, else strings."""
    if keys.dtype.kind in "iu" and wanted.dtype.kind in "iu":
        return keys.astype(np.int64), wanted.astype(np.int64)
    return keys.astype(str), wanted.astype(str)


def attach(raw: RawFeatures, row_raw_ids: np.ndarray, names: list[str] | None = None) -> Features:
    """Features of a dataset's rows (``row_raw_ids``: each row's id in the source, e.g. ``item_raw_ids``).

    Rows the side file does not list get no values; values are numbered densely in sorted token order,
    counting only the rows kept (so a feature table holds no value no kept row has). ``names``: the
    fields to keep (None: all), an unknown one a UserError naming the file.
    """
    chosen = list(raw.fields) if names is None else names
    unknown = [n for n in chosen if n not in raw.fields]
    if unknown:
        raise UserError(f"{raw.source}: no field(s) {', '.join(unknown)} "
                        f"(fields: {', '.join(raw.fields) or 'none'})")
    keys, wanted = _normalise_keys(raw.keys, np.asarray(row_raw_ids))
    order = np.argsort(keys, kind="stable")
    pos = np.searchsorted(keys, wanted, sorter=order)
    pos = np.minimum(pos, max(len(keys) - 1, 0))
    found = (keys[order[pos]] == wanted) if len(keys) else np.zeros(len(wanted), dtype=bool)
    src_row = np.where(found, order[pos], -1)
    out = []
    for name in chosen:
        offs, tokens = raw.fields[name]
        starts = np.where(found, offs[src_row], 0)
        counts = np.where(found, offs[src_row + 1] - starts, 0)
        new_offs = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum(counts, out=new_offs[1:])
        idx = np.repeat(starts - new_offs[:-1], counts) + np.arange(int(new_offs[-1]))
        vocab, values = np.unique(tokens[idx].astype(str), return_inverse=True)
        out.append(FeatureField(name, new_offs, values.reshape(-1).astype(np.int64) + 1, vocab))
    feats = Features(raw.kind, len(wanted), out)
    feats.validate(raw.source)
    return feats


def coverage(feats: Features) -> dict[str, float]:
    """Share of rows with at least one value, per field (what `grstack data import` reports)."""
    return {f.name: float(np.mean(np.diff(f.offsets) > 0)) if feats.num_rows else 0.0 for f in feats.fields}


# -- on disk --------------------------------------------------------------------------------------------------
def _list_column(f: FeatureField) -> pa.ListArray:
    if f.offsets[-1] >= 2**31:
        raise ValueError(f"feature {f.name!r} has more than 2**31 values")
    return pa.ListArray.from_arrays(pa.array(f.offsets.astype(np.int32)), pa.array(f.values, type=pa.int64()))


def write_features(out: Path, feats: dict[Kind, Features], row_ids: dict[Kind, np.ndarray]) -> dict:
    """Writes the feature files into ``out``; returns the ``meta.json`` entries that name them."""
    meta: dict = {}
    vocab_rows: dict[str, list] = {"kind": [], "field": [], "value_id": [], "raw": []}
    for kind, fs in feats.items():
        if not fs.fields:
            continue
        cols = {KEYS[kind]: pa.array(row_ids[kind], type=pa.int64())}
        for f in fs.fields:
            cols[f.name] = _list_column(f)
            vocab_rows["kind"] += [kind] * f.num_values
            vocab_rows["field"] += [f.name] * f.num_values
            vocab_rows["value_id"] += list(range(1, f.num_values + 1))
            vocab_rows["raw"] += [str(t) for t in f.vocab]
        pq.write_table(pa.table(cols), out / FILES[kind])
        meta[f"{kind}_features"] = {"file": FILES[kind], "fields": fs.sizes}
    if meta:
        pq.write_table(pa.table({"kind": pa.array(vocab_rows["kind"], pa.string()),
                                 "field": pa.array(vocab_rows["field"], pa.string()),
                                 "value_id": pa.array(vocab_rows["value_id"], pa.int64()),
                                 "raw": pa.array(vocab_rows["raw"], pa.string())}), out / VOCAB_FILE)
    return meta


def read_features(path: Path, meta: dict, kind: Kind, row_ids: np.ndarray) -> Features | None:
    """The ``kind`` features of a dataset directory for rows ``row_ids`` (None when it has none)."""
    entry = meta.get(f"{kind}_features")
    if not entry:
        return None
    f_path = path / str(entry.get("file", FILES[kind]))
    for needed in (f_path, path / VOCAB_FILE):
        if not needed.is_file():
            what = "a directory" if needed.is_dir() else "missing"
            raise UserError(f"{needed}: {what}, but meta.json names it as the {kind} features' Parquet file")
    try:
        table = pq.read_table(f_path)
        vocab = pq.read_table(path / VOCAB_FILE, columns=["kind", "field", "raw"])
    except (OSError, pa.ArrowInvalid) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: {kind} features named in meta.json cannot be read ({first})") from None
    key = KEYS[kind]
    sizes = dict(entry.get("fields") or {})
    if key not in table.column_names or any(n not in table.column_names for n in sizes):
        raise UserError(f"{f_path}: expected columns {key!r} and {', '.join(sizes)}")
    ids = table.column(key).to_numpy().astype(np.int64)
    order = np.argsort(ids, kind="stable")
    pos = np.minimum(np.searchsorted(ids, row_ids, sorter=order), max(len(ids) - 1, 0))
    if len(ids) == 0 or not np.array_equal(ids[order[pos]], row_ids):
        raise UserError(f"{f_path}: does not cover every {key} of the dataset")
    rows = order[pos]
    # One vectorised pass over the vocabulary (it holds a row per value: millions for ids like authors).
    of_kind = np.asarray(vocab.column("kind").to_numpy(zero_copy_only=False), dtype=str) == kind
    field_names = np.asarray(vocab.column("field").to_numpy(zero_copy_only=False), dtype=str)[of_kind]
    raw_words = np.asarray(vocab.column("raw").to_numpy(zero_copy_only=False), dtype=str)[of_kind]
    fields = []
    for name, size in sizes.items():
        col = table.column(name).combine_chunks()
        offs = np.asarray(col.offsets, dtype=np.int64)
        offs = offs - offs[0]
        words = raw_words[field_names == name]
        if len(words) != int(size):
            raise UserError(f"{path / VOCAB_FILE}: {kind} feature {name!r} has {len(words)} values, "
                            f"meta.json says {size}")
        fields.append(FeatureField(name, offs, np.asarray(col.flatten(), dtype=np.int64), words))
    feats = Features(kind, len(ids), fields).take_rows(rows)
    feats.validate(str(f_path))
    return feats

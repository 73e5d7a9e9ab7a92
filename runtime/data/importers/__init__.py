"""Importers from public formats into the grstack sequence format: ``import_dataset(fmt, src, **opts)``.

Formats: ``amazon`` (Amazon 2014 ``ratings_*.csv``), ``recbole`` (atomic ``.inter`` file), ``seqtxt`` (S3-Rec ``user i1 i2 ...``), ``movielens``
(``ratings.dat``, ``u.data``, ``ratings.csv``), ``kuairand`` (``log_standard_*.csv``). Common options:
``min_len`` (drop users with fewer events; default 3, the minimum for leave-one-out), ``name`` and, for
formats with times, ``timestamp_unit`` ("auto", "s", "ms", "us"; stored times are Unix seconds:
``importers/timestamps.py``).
A bad source raises ``UserError`` naming the file and line before anything is written.

Side features (``importers/side.py``): ``item_features``/``user_features`` name a side file or "auto" (the
one matching file beside the source), ``item_fields``/``user_fields`` the categorical fields to keep (None:
all). They are attached to the dataset's items/users by raw id; rows the file does not list get no values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.features import Kind, attach, coverage
from grstack.runtime.data.importers.amazon import import_amazon
from grstack.runtime.data.importers.common import DEFAULT_MIN_LEN, check_missing
from grstack.runtime.data.importers.kuairand import import_kuairand
from grstack.runtime.data.importers.movielens import import_movielens
from grstack.runtime.data.importers.recbole import import_recbole
from grstack.runtime.data.importers.seqtxt import import_seqtxt
from grstack.runtime.data.importers.side import find_side_file, read_side, resolve_side_file
from grstack.runtime.errors import UserError

IMPORTERS: dict[str, Callable[..., SequenceDataset]] = {
    "amazon": import_amazon,
    "kuairand": import_kuairand,
    "movielens": import_movielens,
    "recbole": import_recbole,
    "seqtxt": import_seqtxt,
}
FORMATS = tuple(IMPORTERS)


def import_dataset(fmt: str, src: str | Path, *, item_features: str | Path | None = None,
                   user_features: str | Path | None = None, item_fields: list[str] | None = None,
                   user_fields: list[str] | None = None, **opts: object) -> SequenceDataset:
    """Reads ``src`` (a file or a directory holding one) in format ``fmt`` into a validated dataset, with the
    item/user side features of ``item_features``/``user_features`` (a file, or "auto") when given."""
    if fmt not in IMPORTERS:
        raise UserError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    fn = IMPORTERS[fmt]
    accepted = set(inspect.signature(fn).parameters) - {"src"}
    unknown = sorted(set(opts) - accepted)
    if unknown:
        raise UserError(f"format {fmt!r} takes no option(s) {', '.join(unknown)} "
                        f"(options: {', '.join(sorted(accepted))})")
    path = Path(src)
    check_missing(path)
    sides: dict[Kind, tuple[Path, list[str] | None]] = {}
    wanted: tuple[tuple[Kind, str | Path | None, list[str] | None], ...] = (
        ("item", item_features, item_fields), ("user", user_features, user_fields))
    for kind, spec, fields in wanted:
        if fields is not None and not fields:
            raise UserError(f"{kind} fields: an empty list (leave it out for every field)")
        if spec is not None:
            sides[kind] = (resolve_side_file(fmt, kind, path, spec), fields)
        elif fields is not None:
            raise UserError(f"{kind} fields given without a {kind} side file (--{kind}-features FILE|auto)")
    raws = {kind: read_side(fmt, kind, side, fields) for kind, (side, fields) in sides.items()}
    ds = fn(path, **opts)
    for kind, raw in raws.items():
        if kind == "item":
            rows = ds.item_raw_ids if ds.item_raw_ids is not None else np.arange(1, ds.num_items + 1)
        else:
            rows = ds.user_raw_ids if ds.user_raw_ids is not None else ds.user_ids
        feats = attach(raw, rows)  # the reader kept only the chosen fields, in order
        if kind == "item":
            ds.item_features = feats
        else:
            ds.user_features = feats
        ds.info[f"{kind}_features"] = {"file": str(sides[kind][0]),
                                       "coverage": {k: round(v, 6) for k, v in coverage(feats).items()}}
    ds.validate()
    return ds


__all__ = ["DEFAULT_MIN_LEN", "FORMATS", "IMPORTERS", "find_side_file", "import_dataset"]

"""Importers from public formats into the grstack sequence format: ``import_dataset(fmt, src, **opts)``.

Formats: ``recbole`` (atomic ``.inter`` file), ``seqtxt`` (S3-Rec ``user i1 i2 ...``), ``movielens``
(``ratings.dat``, ``u.data``, ``ratings.csv``), ``kuairand`` (``log_standard_*.csv``). Common options:
``min_len`` (drop users with fewer events; default 3, the minimum for leave-one-out) and ``name``.
A bad source raises ``UserError`` naming the file and line before anything is written.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.importers.common import DEFAULT_MIN_LEN, check_missing
from grstack.runtime.data.importers.kuairand import import_kuairand
from grstack.runtime.data.importers.movielens import import_movielens
from grstack.runtime.data.importers.recbole import import_recbole
from grstack.runtime.data.importers.seqtxt import import_seqtxt
from grstack.runtime.errors import UserError

IMPORTERS: dict[str, Callable[..., SequenceDataset]] = {
    "kuairand": import_kuairand,
    "movielens": import_movielens,
    "recbole": import_recbole,
    "seqtxt": import_seqtxt,
}
FORMATS = tuple(IMPORTERS)


def import_dataset(fmt: str, src: str | Path, **opts: object) -> SequenceDataset:
    """Reads ``src`` (a file or a directory holding one) in format ``fmt`` into a validated dataset."""
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
    return fn(path, **opts)


__all__ = ["DEFAULT_MIN_LEN", "FORMATS", "IMPORTERS", "import_dataset"]

"""Where fetched datasets live, and ``fetched:NAME`` data sources resolved to them.

Cache directory: ``--cache-dir``, else ``$GRSTACK_DATA_DIR``, else ``$XDG_CACHE_HOME/grstack/data``, else
``~/.cache/grstack/data``. One directory per dataset::

    <cache>/<name>/
        downloads/<file>        the upstream files, verified (kept, so a re-import needs no download);
                                <file>.part while one is downloading (a rerun resumes it)
        dataset/                the imported grstack Parquet dataset (what ``fetched:<name>`` reads)
        fetch.json              what was fetched: files, URLs, sizes, checksums, import options, summary;
                                written last, so its presence means the dataset is complete
        raw/                    extracted archive members, only while the import runs

A config reads a fetched dataset with ``data.format: parquet`` and ``data.source: fetched:<name>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from grstack.runtime.data.fetch.catalog import lookup
from grstack.runtime.errors import UserError

ENV_DIR = "GRSTACK_DATA_DIR"
PREFIX = "fetched:"
RECORD = "fetch.json"
DATASET = "dataset"
DOWNLOADS = "downloads"
RAW = "raw"


def cache_dir(explicit: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The cache directory (module docstring for the order of precedence)."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit).expanduser()
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]).expanduser()
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "grstack" / "data"


def is_complete(cache: Path, name: str) -> bool:
    folder = cache / name
    return (folder / RECORD).is_file() and (folder / DATASET / "meta.json").is_file()


def is_fetched(source: str) -> bool:
    return source.startswith(PREFIX)


def resolve_source(source: str, cache: Path) -> Path:
    """The dataset directory a data source names: ``fetched:NAME`` is NAME's imported dataset in ``cache``
    (a UserError saying how to fetch it when it is not there); anything else is the path it spells."""
    if not is_fetched(source):
        return Path(source)
    name = source[len(PREFIX):]
    try:
        entry = lookup(name)
    except UserError as exc:
        raise UserError(f"data.source {source}: {exc}") from None
    if not is_complete(cache, entry.name):
        raise UserError(f"dataset {entry.name!r} is not in the cache {cache}: run `grstack data fetch {entry.name}`")
    return cache / entry.name / DATASET


def source_path(source: str) -> Path:
    """:func:`resolve_source` against the cache directory of the environment."""
    return resolve_source(source, cache_dir()) if is_fetched(source) else Path(source)


def check_format(source: str, fmt: str) -> None:
    if is_fetched(source) and fmt != "parquet":
        raise UserError(f"data.source {source} is an imported Parquet dataset: it needs data.format parquet, "
                        f"not {fmt}")


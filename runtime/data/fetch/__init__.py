"""Public datasets by name: ``grstack data fetch NAME`` (:mod:`.cli`) downloads the upstream files listed in
the catalogue (:mod:`.catalog`), verifies and imports them into the cache (:mod:`.cache`, :mod:`.fetcher`);
a config then reads ``data.source: fetched:NAME`` (:func:`resolve_source`)."""

from __future__ import annotations

from grstack.runtime.data.fetch.cache import cache_dir, is_fetched, resolve_source, source_path
from grstack.runtime.data.fetch.catalog import CATALOG, DataSet, RemoteFile, lookup

__all__ = ["CATALOG", "DataSet", "RemoteFile", "cache_dir", "is_fetched", "lookup", "resolve_source",
           "source_path"]

"""``grstack data fetch NAME``: a public dataset downloaded, verified and imported into the cache in one step."""

from __future__ import annotations

import argparse
import os
import sys

from grstack.runtime.data.fetch.cache import ENV_DIR, cache_dir
from grstack.runtime.data.fetch.catalog import CATALOG, lookup
from grstack.runtime.data.fetch.fetcher import ENV_URL_BASE, fetch, state
from grstack.runtime.errors import UserError


def _catalogue_text() -> str:
    width = max(len(n) for n in CATALOG) + 2
    lines = ["datasets:"]
    for d in CATALOG.values():
        also = f" (also: {', '.join(d.aliases)})" if d.aliases else ""
        lines.append(f"  {d.name:<{width}}{d.description}{also}")
    lines += ["",
              "Each set lands in <cache>/<name>/: downloads/ (the verified upstream files), dataset/ (the imported",
              "Parquet dataset) and fetch.json (files, checksums, counts). A config reads it with",
              "`data.format: parquet` and `data.source: fetched:<name>`. An interrupted download resumes on the",
              "next run; a complete set is not fetched again. A file downloaded by hand can be put in",
              "<cache>/<name>/downloads/ under its published name: it is verified, then used. The usual",
              "https_proxy / http_proxy / no_proxy environment variables apply."]
    return "\n".join(lines)


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def _list(args: argparse.Namespace) -> int:
    cache = cache_dir(args.cache_dir)
    width = max(len(n) for n in CATALOG) + 2
    print(f"cache: {cache}")
    for d in CATALOG.values():
        print(f"{d.name:<{width}}{state(cache, d):<12}{d.description}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.list:
        if args.names:
            raise UserError("--list takes no dataset names")
        return _list(args)
    if not args.names:
        raise UserError("name a dataset to fetch (`grstack data fetch --list` shows them)")
    entries = [lookup(n) for n in args.names]  # every name checked before any download
    cache = cache_dir(args.cache_dir)
    url_base = args.url_base or os.environ.get(ENV_URL_BASE) or None
    progress = not args.no_progress and sys.stderr.isatty()
    for entry in {e.name: e for e in entries}.values():
        fetch(entry, cache, url_base=url_base, allow_unpinned=args.allow_unpinned, retries=args.retries,
              timeout=args.timeout, progress=progress)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``fetch`` to the ``grstack data`` subcommands."""
    p = sub.add_parser(
        "fetch", help="download a public dataset (MovieLens, Amazon, KuaiRand) and import it, in one step",
        description="Download public datasets from their publishers (resumable, checked against pinned "
                    "checksums) and import them into the grstack Parquet format in the cache directory.",
        epilog=_catalogue_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help="dataset(s) to fetch (listed below)")
    p.add_argument("--list", action="store_true", help="print every dataset and whether it is in the cache")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help=f"cache directory (default: ${ENV_DIR}, else $XDG_CACHE_HOME/grstack/data, else "
                        "~/.cache/grstack/data)")
    p.add_argument("--url-base", default=None, metavar="URL",
                   help=f"fetch every file from URL/<file name> instead of its publisher: a mirror or proxy "
                        f"(default: ${ENV_URL_BASE}, else the publishers' URLs)")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="fetch files that have no published checksum (amazon-books), printing the sha256 they "
                        "have (default: refuse them)")
    p.add_argument("--retries", type=_nonnegative, default=3, metavar="N",
                   help="tries after a dropped connection, a timeout or a server error, each resuming the "
                        "download (default 3)")
    p.add_argument("--timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="seconds without data before a connection counts as dropped (default 60)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: a bar on stderr when it is a terminal)")
    p.set_defaults(func=_run)

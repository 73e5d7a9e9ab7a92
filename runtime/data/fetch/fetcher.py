"""One dataset from its upstream files to an imported grstack dataset in the cache (layout: :mod:`.cache`):
download (resumable, verified), extract, then the same import ``grstack data import`` runs.

A complete dataset is never fetched twice. A failure leaves the verified downloads and the ``.part`` of an
interrupted one (the next run resumes it) and nothing else: no extracted files, no partial dataset.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grstack.runtime.data.fetch.cache import DATASET, DOWNLOADS, PREFIX, RAW, RECORD, is_complete
from grstack.runtime.data.fetch.catalog import DataSet, RemoteFile
from grstack.runtime.data.fetch.download import Digests, download, part_path, verify
from grstack.runtime.data.fetch.extract import extract
from grstack.runtime.errors import UserError

ENV_URL_BASE = "GRSTACK_DATA_URL_BASE"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def human(n: int | None) -> str:
    if n is None:
        return "size unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def file_url(f: RemoteFile, url_base: str | None) -> str:
    """Upstream, or ``<url_base>/<file name>`` on a mirror."""
    return f"{url_base.rstrip('/')}/{f.name}" if url_base else f.url


def state(cache: Path, entry: DataSet) -> str:
    """fetched, downloaded (every file, not imported), partial (some bytes) or absent."""
    if is_complete(cache, entry.name):
        return "fetched"
    downloads = cache / entry.name / DOWNLOADS
    have = [(downloads / f.name).is_file() for f in entry.files]
    if all(have):
        return "downloaded"
    if any(have) or any(part_path(downloads / f.name).is_file() for f in entry.files):
        return "partial"
    return "absent"


def read_record(cache: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((cache / name / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@contextmanager
def _locked(folder: Path, name: str) -> Iterator[None]:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"cannot write the cache directory {folder}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another `grstack data fetch {name}` is running on {folder}") from None
        yield
    finally:
        os.close(fd)


def _check_space(folder: Path, entry: DataSet) -> None:
    downloads = folder / DOWNLOADS
    need = 0
    for f in entry.files:
        if f.size is None or (downloads / f.name).is_file():
            continue
        part = part_path(downloads / f.name)
        need += f.size - (part.stat().st_size if part.is_file() else 0)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise UserError(f"{entry.name}: the downloads need {human(need)}, {folder} has {human(free)} free")


def _obtain(f: RemoteFile, downloads: Path, url: str, retries: int, timeout: float, progress: bool) -> Digests:
    dest = downloads / f.name
    if dest.is_file():  # verified when it was downloaded; checked again, it may have been put there by hand
        return verify(dest, size=f.size, sha256=f.sha256, md5=f.md5, label=str(dest))
    _note(f"downloading {f.name} ({human(f.size)}) from {url}")
    return download(url, dest, size=f.size, sha256=f.sha256, md5=f.md5, retries=retries, timeout=timeout,
                    progress=progress)


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        try:
            shutil.copyfile(src, dest)
        except OSError as exc:
            raise UserError(f"cannot write {dest}: {exc.strerror or exc}") from None


def _unpack(entry: DataSet, downloads: Path, raw: Path) -> None:
    shutil.rmtree(raw, ignore_errors=True)
    try:
        raw.mkdir(parents=True)
    except OSError as exc:
        raise UserError(f"cannot write {raw}: {exc.strerror or exc}") from None
    for f in entry.files:
        if f.archive is None:
            _link_or_copy(downloads / f.name, raw / f.name)
        else:
            _note(f"extracting {', '.join(f.members)} from {f.name}")
            extract(downloads / f.name, f.archive, f.members, raw)


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / f".{RECORD}.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(folder / RECORD)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {folder / RECORD}: {exc.strerror or exc}") from None


def _differences(entry: DataSet, summary: dict[str, int]) -> list[str]:
    return [f"{key} {summary.get(key)}, published {want}" for key, want in entry.expect.items()
            if summary.get(key) is not None and summary.get(key) != want]


def fetch(entry: DataSet, cache: Path, *, url_base: str | None = None, allow_unpinned: bool = False,
          retries: int = 3, timeout: float = 60.0, progress: bool = True,
          say: Callable[[str], None] = print) -> Path:
    """``entry`` into ``cache`` (a no-op when it is there already); returns its dataset directory."""
    folder = cache / entry.name
    if is_complete(cache, entry.name):
        s = read_record(cache, entry.name).get("summary", {})
        counts = f" ({s['users']} users, {s['items']} items, {s['events']} events)" if s else ""
        say(f"{entry.name} is already in the cache: {folder / DATASET}{counts}")
        return folder / DATASET
    unpinned = [f for f in entry.files if not f.pinned]
    if unpinned and not allow_unpinned:
        f = unpinned[0]
        raise UserError(f"{entry.name}: {f.name} has no published checksum ({f.unpinned or 'unpinned'}); rerun "
                        f"with --allow-unpinned to fetch it unverified (its sha256 is printed, to pin it)")
    from grstack.runtime.data.dataset import write_dataset
    from grstack.runtime.data.importers import import_dataset

    with _locked(folder, entry.name):
        if is_complete(cache, entry.name):  # completed by another fetch between the check above and the lock
            say(f"{entry.name} is already in the cache: {folder / DATASET}")
            return folder / DATASET
        _check_space(folder, entry)
        if entry.terms:
            _note(f"{entry.name}: terms of use: {entry.terms}")
        downloads, raw = folder / DOWNLOADS, folder / RAW
        files = []
        for f in entry.files:
            url = file_url(f, url_base)
            got = _obtain(f, downloads, url, retries, timeout, progress)
            if not f.pinned:
                _note(f"note: {f.name} is unpinned; its sha256 is {got.sha256} ({got.size} bytes)")
            files.append({"name": f.name, "url": url, "size": got.size, "sha256": got.sha256, "md5": got.md5,
                          "pinned": f.pinned})
        try:
            _unpack(entry, downloads, raw)
            shutil.rmtree(folder / DATASET, ignore_errors=True)  # an import that died before its record
            _note(f"importing {entry.name} (format {entry.format})")
            options = dict(entry.options)
            ds = import_dataset(entry.format, raw, name=entry.name, **options)
            ds.source = f"{PREFIX}{entry.name} ({entry.format}: {', '.join(f.name for f in entry.files)})"
            out = write_dataset(ds, folder / DATASET)
            summary = {"users": ds.num_users, "items": ds.num_items, "events": ds.num_events,
                       "raw_events": int(ds.info.get("raw_events", ds.num_events))}
            _write_record(folder, {
                "name": entry.name, "description": entry.description, "source": f"{PREFIX}{entry.name}",
                "fetched_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "files": files,
                "format": entry.format, "options": options, "summary": summary,
                "homepage": entry.homepage, "terms": entry.terms,
            })
        except BaseException:
            if not is_complete(cache, entry.name):
                shutil.rmtree(folder / DATASET, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(raw, ignore_errors=True)
    for diff in _differences(entry, summary):
        _note(f"note: {entry.name}: {diff}")
    say(f"fetched {entry.name}: {summary['users']} users, {summary['items']} items, {summary['events']} events "
        f"-> {out} (data.source: {PREFIX}{entry.name})")
    return out

"""Resumable HTTP(S) download into ``<file>.part`` (HTTP Range), verified by size and checksum before it
takes the file's name.

A dropped connection, a timeout or a 5xx answer is retried (resuming where the ``.part`` ends) up to
``retries`` times; what is left after the last try is the ``.part``, which the next run resumes. A server that
ignores the Range header (status 200) restarts the file. A wrong size or checksum deletes the download and
refuses it by name: nothing unverified is ever kept under the file's own name.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from grstack.runtime.errors import UserError

CHUNK = 1 << 20
USER_AGENT = "grstack-data-fetch (python urllib)"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class _Retry(Exception):
    """A failure worth another try (the connection, not the file)."""


@dataclass(frozen=True)
class Digests:
    size: int
    sha256: str
    md5: str


def digests(path: Path) -> Digests:
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    size = 0
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            sha.update(block)
            md5.update(block)
            size += len(block)
    return Digests(size, sha.hexdigest(), md5.hexdigest())


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def verify(path: Path, *, size: int | None, sha256: str | None, md5: str | None, label: str) -> Digests:
    """The file's digests; a mismatch with what is pinned deletes it and raises a UserError naming it."""
    got = digests(path)
    problem = None
    if size is not None and got.size != size:
        problem = f"size {got.size} bytes, pinned {size}"
    elif sha256 is not None and got.sha256 != sha256.lower():
        problem = f"sha256 {got.sha256}, pinned {sha256}"
    elif md5 is not None and got.md5 != md5.lower():
        problem = f"md5 {got.md5}, pinned {md5}"
    if problem:
        path.unlink(missing_ok=True)
        raise UserError(f"{label}: checksum mismatch ({problem}): not the published file, deleted")
    return got


def _write_error(path: Path, exc: OSError) -> UserError:
    return UserError(f"cannot write {path}: {exc.strerror or exc}")


def _transfer(url: str, part: Path, size: int | None, timeout: float, progress: bool, label: str) -> None:
    """One request: appends to ``part`` from where it ends (or restarts it); _Retry when cut short."""
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if size is not None and have == size:
        return  # complete: verify() decides
    headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # nothing after what we have: complete, or the server's file is shorter
            if size is None or have == size:
                return
            part.unlink()
            raise _Retry("the server refused to resume (HTTP 416)") from None
        if exc.code in (408, 425, 429) or exc.code >= 500:
            raise _Retry(f"HTTP {exc.code} {exc.reason}") from None
        raise UserError(f"downloading {url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason.strerror if isinstance(exc.reason, OSError) and exc.reason.strerror else exc.reason
        raise _Retry(f"cannot reach {urllib.parse.urlsplit(url).netloc}: {reason}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Retry(f"{type(exc).__name__}: {exc}") from None
    with resp:
        total: int | None
        if resp.status == 206:
            m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "").strip())
            if m is None or int(m.group(1)) != have:
                part.unlink()
                raise _Retry("the server answered the resume with another range; restarting")
            total = int(m.group(3)) if m.group(3) != "*" else None
            mode = "ab"
        elif resp.status == 200:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            have, mode = 0, "wb"
        else:
            raise UserError(f"downloading {url}: unexpected HTTP {resp.status} {resp.reason}")
        if size is not None and total is not None and total != size:
            part.unlink(missing_ok=True)
            raise UserError(f"{label}: the server has {total} bytes, the catalogue pins {size}: not the published "
                            f"file ({url})")
        _stream(resp, part, mode, have, total if total is not None else size, progress, label)


def _stream(resp: http.client.HTTPResponse, part: Path, mode: str, have: int, total: int | None,
            progress: bool, label: str) -> None:
    from tqdm import tqdm

    try:
        f = part.open(mode)
    except OSError as exc:
        raise _write_error(part, exc) from None
    with f, tqdm(total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                 file=sys.stderr, disable=not progress, leave=False) as bar:
        while True:
            try:
                block = resp.read(CHUNK)
            except (OSError, http.client.HTTPException) as exc:
                raise _Retry(f"connection lost after {have} bytes ({type(exc).__name__})") from None
            if not block:
                break
            try:
                f.write(block)
            except OSError as exc:
                raise _write_error(part, exc) from None
            have += len(block)
            bar.update(len(block))
    if total is not None and have < total:
        raise _Retry(f"connection closed after {have} of {total} bytes")


def download(url: str, dest: Path, *, size: int | None, sha256: str | None = None, md5: str | None = None,
             retries: int = 3, timeout: float = 60.0, progress: bool = True, backoff: float = 1.0) -> Digests:
    """``url`` -> ``dest`` through ``dest.part``, resumed where an earlier run stopped; verified before the
    rename. Returns the file's digests (the sha256 is what pins an unpinned file)."""
    part = part_path(dest)
    label = dest.name
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(dest.parent, exc) from None
    for attempt in range(retries + 1):
        try:
            _transfer(url, part, size, timeout, progress, label)
            break
        except _Retry as exc:
            if attempt == retries:
                kept = (f"; {part} ({part.stat().st_size} bytes) is kept: rerun to resume"
                        if part.exists() and part.stat().st_size else "")
                tries = f" (after {retries + 1} tries)" if retries else ""
                raise UserError(f"downloading {url}: {exc}{tries}{kept}") from None
            time.sleep(backoff * (attempt + 1))
    got = verify(part, size=size, sha256=sha256, md5=md5, label=f"{label} from {url}")
    try:
        part.replace(dest)
    except OSError as exc:
        raise _write_error(dest, exc) from None
    return got

"""Extracts the members an import needs from a downloaded archive (zip, or tar with any compression) into
one flat directory: each member under its base name, so the importers find them beside each other and no
member path can point outside the directory. Only regular files are extracted; a tar is read as a stream
(one pass, whatever its size)."""

from __future__ import annotations

import fnmatch
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import IO

from grstack.runtime.errors import UserError


class _Picker:
    """Which members to take, by pattern; refuses two members with the same base name."""

    def __init__(self, archive: Path, patterns: Iterable[str], dest: Path) -> None:
        self.archive, self.patterns, self.dest = archive, tuple(patterns), dest
        self.matched: dict[str, int] = dict.fromkeys(self.patterns, 0)
        self.taken: dict[str, str] = {}

    def target(self, member: str) -> Path | None:
        hits = [p for p in self.patterns if fnmatch.fnmatchcase(member, p)]
        if not hits:
            return None
        for p in hits:
            self.matched[p] += 1
        base = PurePosixPath(member).name
        if base in self.taken:
            raise UserError(f"{self.archive}: members {self.taken[base]} and {member} have the same file name")
        self.taken[base] = member
        return self.dest / base

    def check(self) -> list[Path]:
        missing = [p for p, n in self.matched.items() if n == 0]
        if missing:
            raise UserError(f"{self.archive}: no member matches {', '.join(missing)} (is it the published archive?)")
        return [self.dest / b for b in sorted(self.taken)]


def _copy(src: IO[bytes], target: Path) -> None:
    """Read errors (a damaged archive) propagate; write errors (the disk) become a UserError naming it."""
    try:
        out = target.open("wb")
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None
    with out:
        while block := src.read(1 << 20):
            try:
                out.write(block)
            except OSError as exc:
                raise UserError(f"cannot write {target}: {exc.strerror or exc}") from None


def extract(archive: Path, kind: str, patterns: Iterable[str], dest: Path) -> list[Path]:
    """The members of ``archive`` matching ``patterns`` (every pattern must match one) written to ``dest``."""
    picker = _Picker(archive, patterns, dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    target = None if info.is_dir() else picker.target(info.filename)
                    if target is not None:
                        with zf.open(info) as src:
                            _copy(src, target)
        elif kind == "tar":
            with tarfile.open(archive, "r|*") as tf:
                for member in tf:
                    target = picker.target(member.name) if member.isfile() else None
                    if target is not None:
                        member_file = tf.extractfile(member)
                        assert member_file is not None  # a regular file always has content
                        with member_file:
                            _copy(member_file, target)
        else:
            raise UserError(f"{archive}: unknown archive kind {kind!r}")
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise UserError(f"{archive}: not a readable {kind} archive ({exc})") from None
    return picker.check()

"""Sharded checkpoints: every rank writes its part, rank 0 commits the whole (a one-rank run writes one part).

Layout: ``checkpoints/step-000000012/`` holds ``manifest.json`` (world size, sparse groups, table shape,
config, the sha256 of every other file), ``dense.pt`` (dense model, dense optimizer, training state; from
rank 0) and ``rank-00001.pt`` (that rank's embedding shard, sparse optimizer state and RNG state). Parts are
written into ``checkpoints/.tmp-step-000000012/``; after every rank has written (a gather of their files'
digests), rank 0 writes the manifest and renames the directory. A directory without a manifest is never resumed from, so a job killed halfway
leaves nothing that looks complete.

Files are read without running code (model/torch_files.py) and each is checked against the manifest's digest
before it is parsed, so a corrupted or substituted shard is refused by name. Version 1 manifests (before
digests) still resume, through the same restricted unpickler.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from grstack.runtime.errors import UserError
from grstack.runtime.model import atomic_torch_save, load_checkpoint
from grstack.runtime.train.context import DistContext

CHECKPOINT_DIR = "checkpoints"
FORMAT = "grstack-sharded-checkpoint"
VERSION = 2
LEGACY_VERSIONS = (1,)  # no digests
MANIFEST = "manifest.json"
DENSE = "dense.pt"
_NAME = re.compile(r"^step-(\d{9})$")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step-{step:09d}"


def list_complete(run_dir: Path) -> list[Path]:
    d = run_dir / CHECKPOINT_DIR
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file())


def latest(run_dir: Path) -> Path | None:
    found = list_complete(run_dir)
    return found[-1] if found else None


def remove_partial(run_dir: Path) -> None:
    d = run_dir / CHECKPOINT_DIR
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(".tmp-step-") or (_NAME.match(p.name) and not (p / MANIFEST).is_file()):
                shutil.rmtree(p, ignore_errors=True)


def save(ctx: DistContext, run_dir: Path, step: int, manifest: dict[str, Any], dense: dict[str, Any],
         part: dict[str, Any], keep: int) -> Path:
    final = step_dir(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.world.barrier()
    digest = atomic_torch_save(part, tmp / rank_file(ctx.rank))
    files = {DENSE: atomic_torch_save(dense, tmp / DENSE)} if ctx.rank == 0 else {}
    digests = ctx.world.all_gather_object(digest)  # every part is on disk
    if ctx.rank == 0:
        files.update({rank_file(r): d for r, d in enumerate(digests)})
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "step": step, **manifest,
                                                "files": files}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_complete(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    ctx.world.barrier()
    return final


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"checkpoint {path} has no readable {MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} is not a grstack sharded checkpoint")
    version = manifest.get("version")
    if version not in (*LEGACY_VERSIONS, VERSION):
        raise UserError(f"checkpoint {path} has format version {version} (this grstack reads up to {VERSION}): "
                        f"resume it with the grstack that wrote it, or start over in a new --out directory")
    if version == VERSION and not isinstance(manifest.get("files"), dict):
        raise UserError(f"checkpoint {path}: {MANIFEST} lists no file digests (it was altered)")
    return manifest


def _load_file(path: Path, name: str, what: str) -> dict[str, Any]:
    """``path/name`` checked against the manifest's digest (a version-1 checkpoint has none)."""
    manifest = read_manifest(path)
    digest = None
    if manifest["version"] == VERSION:
        digest = manifest["files"].get(name)
        if not isinstance(digest, str):
            raise UserError(f"checkpoint {path}: {MANIFEST} lists no digest for {name} (it was altered)")
    return load_checkpoint(path / name, what, digest, path / MANIFEST)


def check_layout(path: Path, manifest: dict[str, Any], world_size: int, group_size: int) -> None:
    got_w, got_g = manifest.get("world_size"), manifest.get("sparse_group_size")
    if got_w != world_size or got_g != group_size:
        raise UserError(
            f"checkpoint {path} was written by {got_w} rank(s) in sparse groups of {got_g}; this job has "
            f"{world_size} rank(s) in groups of {group_size}: resume with the same layout (--nproc {got_w}) "
            f"or use a new --out directory")


def load_part(path: Path, rank: int) -> dict[str, Any]:
    f = path / rank_file(rank)
    if not f.is_file():
        raise UserError(f"checkpoint {path} lacks {f.name} (each rank must see the run directory)")
    return _load_file(path, f.name, "checkpoint shard")


def load_dense(path: Path) -> dict[str, Any]:
    return _load_file(path, DENSE, "checkpoint dense state")

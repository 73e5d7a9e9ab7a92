"""The torch files grstack writes and reads (exported models, their item-row parts, checkpoint shards).

A torch file is a pickle, and unpickling an arbitrary pickle runs arbitrary code. grstack writes only
tensors and plain values (dicts, lists, tuples, strings, numbers, booleans, None), so it reads every file
with torch's restricted unpickler (``weights_only=True``): a file holding anything else is refused before
any of it is built, whoever wrote it. Digests catch what the restricted unpickler cannot: a file corrupted
or replaced by another well-formed one. Two kinds: :func:`file_sha256` of a file's bytes, listed by a
manifest or by the file that names it, checked before the file is parsed; :func:`content_sha256` of a
loaded object, which a file can carry about itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grstack.runtime.errors import UserError

_CHUNK = 1 << 20
_SCALARS = (str, int, float, bool, type(None))
_TORCH_VALUES = (torch.Tensor, torch.Size, torch.dtype, torch.device)  # the restricted unpickler builds these


def plain(obj: Any) -> Any:
    """``obj`` with numpy scalars and subclasses of str/int/float (enums) as plain Python values; a TypeError
    for anything else the restricted unpickler would refuse to read back (so a writer fails at once, not the
    resume that reads the file)."""
    if type(obj) in _SCALARS or isinstance(obj, _TORCH_VALUES):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    for base in (bool, int, float, str):
        if isinstance(obj, base):
            return base(obj)
    if isinstance(obj, dict):
        items = [(plain(k), plain(v)) for k, v in obj.items()]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        return type(obj)(plain(x) for x in obj)
    raise TypeError(f"a grstack torch file holds only tensors and plain values, not {type(obj).__name__}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)};".encode())
        for k in sorted(obj, key=lambda k: json.dumps(k)):
            _feed(h, k)
            _feed(h, obj[k])
    elif isinstance(obj, list | tuple):
        h.update(f"L{len(obj)};".encode())
        for x in obj:
            _feed(h, x)
    else:
        h.update(f"S{json.dumps(obj)};".encode())


def content_sha256(obj: Any) -> str:
    """A digest of tensors and plain values that does not depend on how they were serialised (tensors by
    dtype, shape and bytes; dict keys in sorted order)."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def atomic_torch_save(obj: Any, path: Path) -> str:
    """``torch.save`` of :func:`plain` ``obj`` to a temporary file and rename (a reader never sees half a
    file); returns the file's sha256."""
    obj = plain(obj)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        digest = file_sha256(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return digest


def _global(exc: Exception) -> str | None:
    """The callable a refused pickle names, if that is why torch's restricted unpickler refused it."""
    m = re.search(r"GLOBAL (\S+)", str(exc))
    return m.group(1) if m else None


def safe_torch_load(path: Path, what: str = "checkpoint", sha256: str | None = None,
                    listed_by: Path | None = None) -> Any:
    """A torch file read with the restricted unpickler; ``sha256`` (the file digest ``listed_by`` records)
    is checked before the file is parsed. Every failure is a one-line UserError naming the file."""
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    if sha256 is not None and file_sha256(path) != sha256:
        by = f" recorded in {listed_by}" if listed_by is not None else ""
        raise UserError(f"{what} {path}: sha256 mismatch with the digest{by} (file corrupted or replaced)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about pickle protocols of files it then refuses
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        name = _global(exc) if isinstance(exc, pickle.UnpicklingError) else None
        if name is not None:
            raise UserError(f"{what} {path} was refused: it names the Python callable {name}, and grstack "
                            f"writes only tensors and plain values (a file grstack did not write, or one "
                            f"tampered with; nothing in it was run)") from None
        lines = str(exc).strip().splitlines()
        detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        if isinstance(exc, pickle.UnpicklingError):
            m = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
            detail = f"not a pickle of tensors and plain values: {m.group(1).strip() if m else 'refused'}"
        raise UserError(f"{what} {path} cannot be read (truncated, or not a torch file grstack wrote; "
                        f"{detail})") from None

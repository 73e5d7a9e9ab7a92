"""Prefix identity shared by router and ranker (numpy only: the router does not import torch).

A cached prefix is keyed by user and versioned by a content hash of what its K/V depend on: its (truncated)
items and timestamps, and, for a model that reads them, the events' actions and the user's context (the
user-feature values its contextual tokens head the prefix with). A user's changed history, actions or
attributes can never be served from a stale entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np


def truncate_prefix(items: Sequence[int] | np.ndarray, timestamps: Sequence[int] | np.ndarray,
                    max_prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """The most recent ``max_prefix`` long-term events (the serving truncation rule)."""
    items_a = np.asarray(items, dtype=np.int64)
    ts_a = np.asarray(timestamps, dtype=np.int64)
    if max_prefix <= 0:
        return items_a[:0], ts_a[:0]
    return items_a[-max_prefix:], ts_a[-max_prefix:]


def context_key(user_features: Mapping[str, Sequence[str]] | None, fields: Sequence[str]) -> bytes | None:
    """The canonical bytes of a request's user features for a model that reads ``fields`` (None: it reads
    none): each field's values, sorted (a field's values are pooled, so their order does not matter), in the
    model's field order; fields the model does not read are left out."""
    if not fields:
        return None
    given = user_features or {}
    return json.dumps([sorted(given.get(f, [])) for f in fields], separators=(",", ":")).encode()


def prefix_hash(items: np.ndarray, timestamps: np.ndarray, actions: np.ndarray | None = None,
                context: bytes | None = None) -> str:
    """The version of a prefix of events ``items``/``timestamps`` (with their ``actions`` and the user's
    :func:`context_key` when the model reads them)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(np.ascontiguousarray(items, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(timestamps, dtype=np.int64).tobytes())
    if actions is not None:
        h.update(b"|a")
        h.update(np.ascontiguousarray(actions, dtype=np.int64).tobytes())
    if context is not None:
        h.update(b"|c")
        h.update(context)
    return h.hexdigest()

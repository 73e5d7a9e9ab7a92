"""Prefix identity shared by router and ranker (numpy only: the router does not import torch).

A cached prefix is keyed by user and versioned by a content hash of its (truncated) items and timestamps,
so a user's changed history can never be served from a stale entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def truncate_prefix(items: Sequence[int], timestamps: Sequence[int],
                    max_prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """The most recent ``max_prefix`` long-term events (the serving truncation rule)."""
    items_a = np.asarray(items, dtype=np.int64)
    ts_a = np.asarray(timestamps, dtype=np.int64)
    if max_prefix <= 0:
        return items_a[:0], ts_a[:0]
    return items_a[-max_prefix:], ts_a[-max_prefix:]


def prefix_hash(items: np.ndarray, timestamps: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(np.ascontiguousarray(items, dtype=np.int64).tobytes())
    h.update(b"|")
    h.update(np.ascontiguousarray(timestamps, dtype=np.int64).tobytes())
    return h.hexdigest()

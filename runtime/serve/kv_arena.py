"""A pre-allocated per-replica KV arena: every cached prefix is a token range of one tensor per layer.

Without it each cached prefix is its own set of per-layer tensors: a chunked prefill grows them by
concatenation (O(P^2 / chunk) copied elements for a P-token prefix) and the fused Triton kernel concatenates
the prefixes of a rank batch per layer on every batch. With it, one keys and one values tensor per layer (and
one timestamp row) are allocated once at ranker start from the device cache budget, in the layout the
attention backend wants (``model.prefix_layout(backend)``: [H, T, d] head-major on CPU, [T, H, d] token-major
for Triton); a prefill reserves its whole length up front and writes each chunk's K/V in place, and ranking
passes views of the arena (the CPU kernel takes them as they are, the Triton kernel reads start rows and
lengths: :func:`grstack.kernels.hstu_attention_with_prefix`).

Allocation is first-fit over a sorted list of free ranges, coalesced on free. Contiguous ranges, not pages:
a sequence's prefix must be one strided view for the CPU kernel (a batched matmul with no copy) and a page
table would need a gather there; prefixes are long (hundreds to thousands of tokens) and few, so
first-fit is cheap, and fragmentation is repaired by compaction (moving unpinned ranges down) when no range
fits although enough tokens are free.

Lifetimes: an :class:`ArenaBlock` counts its holders (``refs``: the cache entry, the job computing it, a
result in transit) and the compute work using it (``pins``: a queued or running rank or prefill). Its range
is freed when the last holder releases it; pinned blocks are never moved. Blocks are never reused, so a view
of a freed block is detectably stale (:attr:`ArenaKV.live`). Allocation state is guarded by a lock (the event
loop allocates and frees, the compute thread reads); K/V are written only on the compute thread, into pinned
blocks, or on the event loop into blocks nobody else holds yet.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grstack.runtime.serve.engine import PrefixKV

if TYPE_CHECKING:
    from grstack.runtime.model import HSTU

__all__ = ["ArenaBlock", "ArenaKV", "KVArena"]


@dataclass(eq=False)
class ArenaBlock:
    """Token range ``[start, start + capacity)`` of an arena."""

    start: int
    capacity: int
    refs: int = 1
    pins: int = 0

    @property
    def live(self) -> bool:
        return self.refs > 0


def bytes_per_token(model: HSTU, kv_dtype: torch.dtype | None = None) -> int:
    """Arena bytes of one cached prefix token: every layer's keys and values (in ``kv_dtype``; None: the
    model's), and an int64 timestamp."""
    dtype = kv_dtype if kv_dtype is not None else model.empty_prefix_kv()[0][0].dtype
    return model.kv_elements_per_token * torch.empty(0, dtype=dtype).element_size() + 8


class KVArena:
    """Per-layer keys/values [capacity tokens] and a timestamp row; first-fit allocator over token ranges."""

    def __init__(self, model: HSTU, capacity_tokens: int, *, backend: str | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        """``kv_dtype``: what the K/V are kept in (None: the model's dtype; the engine's ``kv_dtype``)."""
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, got {capacity_tokens}")
        # Each layer's keys/values as the model lays out a prefix (heads, dims, dtype, device), 0 tokens long.
        empty_keys, empty_values = model.empty_prefix_kv(backend)
        self.layout = model.prefix_layout(backend)
        self.capacity = int(capacity_tokens)
        self.device = empty_keys[0].device

        def tensor(empty: torch.Tensor) -> torch.Tensor:
            shape = list(empty.shape)
            shape[self.layout.seq_dim] = self.capacity
            return empty.new_empty(shape, dtype=kv_dtype if kv_dtype is not None else empty.dtype)

        with torch.no_grad():
            self.keys = [tensor(k) for k in empty_keys]
            self.values = [tensor(v) for v in empty_values]
            self.timestamps = torch.empty(self.capacity, dtype=torch.int64, device=self.device)
        self.bytes_per_token = bytes_per_token(model, kv_dtype)
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (start, length), sorted, coalesced
        self._blocks: set[ArenaBlock] = set()
        self._lock = threading.Lock()
        self.compactions = 0
        self.moved_tokens = 0

    @classmethod
    def from_budget(cls, model: HSTU, budget_bytes: int, *, backend: str | None = None,
                    kv_dtype: torch.dtype | None = None) -> KVArena:
        """The largest arena that fits ``budget_bytes`` (the device cache budget)."""
        return cls(model, budget_bytes // bytes_per_token(model, kv_dtype), backend=backend, kv_dtype=kv_dtype)

    # -- inspection ---------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.bytes_per_token

    @property
    def free_tokens(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    @property
    def used_tokens(self) -> int:
        return self.capacity - self.free_tokens

    def largest_free(self) -> int:
        with self._lock:
            return max((n for _, n in self._free), default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self._free)

    def blocks(self) -> list[ArenaBlock]:
        with self._lock:
            return sorted(self._blocks, key=lambda b: b.start)

    # -- allocation ---------------------------------------------------------------------------------
    def alloc(self, tokens: int) -> ArenaBlock | None:
        """A block of ``tokens`` (first fit; one holder: the caller), or None when no free range fits."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        with self._lock:
            if tokens == 0:  # holds nothing: always granted, even when the arena is full
                block = ArenaBlock(0, 0)
                self._blocks.add(block)
                return block
            for i, (start, n) in enumerate(self._free):
                if n >= tokens:
                    if n == tokens:
                        del self._free[i]
                    else:
                        self._free[i] = (start + tokens, n - tokens)
                    block = ArenaBlock(start, tokens)
                    self._blocks.add(block)
                    return block
        return None

    def retain(self, block: ArenaBlock) -> None:
        with self._lock:
            if block.refs <= 0:
                raise RuntimeError("retain of a freed arena block")
            block.refs += 1

    def release(self, block: ArenaBlock) -> None:
        """Drops one holder; the range is freed (and coalesced with its neighbours) when none is left."""
        with self._lock:
            if block.refs <= 0:
                raise RuntimeError("release of a freed arena block")
            block.refs -= 1
            if block.refs == 0:
                self._blocks.discard(block)
                self._insert_free(block.start, block.capacity)

    def pin(self, block: ArenaBlock) -> bool:
        """Compute is about to use the block: holds it and keeps it in place. False if it is already freed."""
        with self._lock:
            if block.refs <= 0:
                return False
            block.refs += 1
            block.pins += 1
            return True

    def unpin(self, block: ArenaBlock) -> None:
        with self._lock:
            block.pins -= 1
        self.release(block)

    def _insert_free(self, start: int, n: int) -> None:
        if n == 0:
            return
        i = bisect.bisect_left(self._free, (start, 0))
        if i > 0 and sum(self._free[i - 1]) == start:  # merge with the range before
            i -= 1
            start, n = self._free[i][0], self._free[i][1] + n
            del self._free[i]
        if i < len(self._free) and start + n == self._free[i][0]:  # and the one after
            n += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, n))

    def compact(self) -> int:
        """Moves unpinned blocks down to close the gaps (pinned ones stay: compute may be reading them), so
        the free tokens form as few ranges as possible. Returns the tokens moved. Event loop only, and only
        blocks nobody computes on move, so the compute thread never sees a range change under it."""
        with self._lock:
            cursor, moved = 0, 0
            for block in sorted(self._blocks, key=lambda b: b.start):
                if block.pins == 0 and block.start > cursor and block.capacity:
                    self._move(block.start, cursor, block.capacity)
                    block.start = cursor
                    moved += block.capacity
                cursor = max(cursor, block.start + block.capacity)
            self._free = []
            cursor = 0
            for block in sorted(self._blocks, key=lambda b: b.start):
                if block.start > cursor:
                    self._free.append((cursor, block.start - cursor))
                cursor = max(cursor, block.start + block.capacity)
            if cursor < self.capacity:
                self._free.append((cursor, self.capacity - cursor))
            self.compactions += 1
            self.moved_tokens += moved
            return moved

    def _move(self, src: int, dst: int, n: int) -> None:
        d = self.layout.seq_dim
        with torch.no_grad():
            for t in (*self.keys, *self.values):
                t.narrow(d, dst, n).copy_(t.narrow(d, src, n).clone())  # ranges may overlap
            self.timestamps[dst:dst + n].copy_(self.timestamps[src:src + n].clone())

    # -- prefixes -----------------------------------------------------------------------------------
    def prefix(self, block: ArenaBlock, length: int = 0) -> ArenaKV:
        return ArenaKV(self, block, length)

    def store(self, block: ArenaBlock, kv: PrefixKV) -> ArenaKV:
        """Copies ``kv`` (any device, this arena's layout) into the first ``kv.length`` tokens of ``block``."""
        if kv.length > block.capacity:
            raise ValueError(f"a {kv.length}-token prefix does not fit a {block.capacity}-token block")
        if kv.ready is not None:  # a copy still filling kv's tensors
            kv = kv.to(self.device)
        out = ArenaKV(self, block, kv.length)
        with torch.no_grad():
            for dst, src in zip((*out.keys, *out.values), (*kv.keys, *kv.values), strict=True):
                dst.copy_(src, non_blocking=True)
            out.timestamps.copy_(kv.timestamps, non_blocking=True)
        return out


class ArenaKV(PrefixKV):
    """The first ``length`` tokens of an arena block as a :class:`PrefixKV`: its keys, values and timestamps
    are views of the arena (computed on access, so a block moved by compaction is read where it now is)."""

    def __init__(self, arena: KVArena, block: ArenaBlock, length: int) -> None:  # fields are views here
        self.arena, self.block, self._length = arena, block, int(length)
        self.ready: Any = None

    def _views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        d = self.arena.layout.seq_dim
        return [t.narrow(d, self.block.start, self._length) for t in tensors]

    @property
    def keys(self) -> list[torch.Tensor]:  # type: ignore[override]
        return self._views(self.arena.keys)

    @property
    def values(self) -> list[torch.Tensor]:  # type: ignore[override]
        return self._views(self.arena.values)

    @property
    def timestamps(self) -> torch.Tensor:  # type: ignore[override]
        return self.arena.timestamps[self.block.start:self.block.start + self._length]

    @property
    def length(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        return self._length * self.arena.bytes_per_token

    @property
    def room(self) -> int:
        return self.block.capacity - self._length

    @property
    def live(self) -> bool:
        return self.block.live

    def grown(self, n: int) -> ArenaKV:
        if n > self.room:
            raise ValueError(f"{n} more tokens do not fit ({self.room} left in the block)")
        return ArenaKV(self.arena, self.block, self._length + n)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PrefixKV:
        """A copy out of the arena (always a copy, even on the arena's own device: the range is reused)."""
        move = lambda t: t.to(device, non_blocking=non_blocking, copy=True)  # noqa: E731
        return PrefixKV([move(k) for k in self.keys], [move(v) for v in self.values], move(self.timestamps))

    def pin(self) -> bool:
        return self.arena.pin(self.block)

    def unpin(self) -> None:
        self.arena.unpin(self.block)

    def release(self) -> None:
        self.arena.release(self.block)

    def __repr__(self) -> str:
        return f"ArenaKV(start={self.block.start}, length={self._length}, capacity={self.block.capacity})"

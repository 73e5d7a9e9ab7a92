"""A bounded, reused pool of host buffers for prefixes evicted to the DRAM tier.

Each eviction used to allocate fresh pinned memory on the event loop (``cudaHostAlloc`` is slow and takes a
driver lock); at the paper's scale an evicted prefix is ~0.5 GB and evictions come at rank rate. The pool
keeps buffers in size classes (eight per power of two, so a buffer wastes at most 1/8 of its bytes) and hands a
freed one out again, so a steady state of similar-sized prefixes allocates nothing. The pool owns at most
``capacity_bytes`` (free and handed out); a request that does not fit after dropping free buffers of other
classes is still served (an overflow, counted) and its buffer is dropped when given back. A buffer whose holder
forgets to give it back is accounted for when it is garbage collected.

On CUDA the buffers are pinned and a given-back buffer carries an event on the compute stream (a promotion's
host-to-device copy may still read it): the next copy into it waits for that event on its side stream, so
nobody blocks. On CPU the buffers are plain memory and the same path runs synchronously.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grstack.runtime.serve.engine import PrefixKV
from grstack.runtime.serve.kv_arena import ArenaKV

__all__ = ["HostPool", "HostPoolStats", "PooledKV", "copy_to_host", "evict_to_host", "size_class"]

ALIGN = 64  # bytes: every tensor carved out of a buffer starts on a cache line (and any dtype's alignment)
MIN_CLASS = 4096


def size_class(nbytes: int) -> int:
    """The buffer size serving ``nbytes``: at least 4 KiB, else rounded up to an eighth of its power of two."""
    if nbytes <= MIN_CLASS:
        return MIN_CLASS
    step = (1 << (nbytes.bit_length() - 1)) // 8
    return -(-nbytes // step) * step


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class HostPoolStats:
    allocations: int = 0  # buffers allocated (each a host allocation; pinned on CUDA)
    reuses: int = 0  # requests served from a freed buffer: no allocation
    overflows: int = 0  # requests served beyond capacity_bytes
    lost: int = 0  # buffers garbage collected without being given back


class HostPool:
    """Size-class free lists of host byte buffers, ``capacity_bytes`` owned at most."""

    def __init__(self, capacity_bytes: int, *, device: torch.device | str = "cpu") -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.stats = HostPoolStats()
        self.owned_bytes = 0
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # class -> [(buffer, event it waits on)]
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}  # id(buffer) handed out -> its finalizer

    @property
    def free_bytes(self) -> int:
        return sum(c * len(bufs) for c, bufs in self._free.items())

    def take(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A uint8 buffer of at least ``nbytes`` and the CUDA event a copy into it must wait for (or None)."""
        c = size_class(nbytes)
        free = self._free.get(c)
        if free:
            buf, event = free.pop()
            self.stats.reuses += 1
        else:
            self._make_room(c)
            if self.owned_bytes + c > self.capacity_bytes:
                self.stats.overflows += 1
            buf, event = torch.empty(c, dtype=torch.uint8, pin_memory=self.pin), None
            self.owned_bytes += c
            self.stats.allocations += 1
        self._finalizers[id(buf)] = weakref.finalize(buf, self._lost, id(buf), c)
        return buf, event

    def give(self, buf: torch.Tensor) -> None:
        """Takes ``buf`` back; on CUDA later copies into it wait for the work now queued on the compute stream."""
        fin = self._finalizers.pop(id(buf), None)
        if fin is None or not fin.detach():
            return  # not handed out by this pool, or given back twice
        c = buf.numel()
        if self.owned_bytes > self.capacity_bytes:  # an overflow's buffer: not kept
            self.owned_bytes -= c
            return
        event = None
        if self.pin and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._free.setdefault(c, []).append((buf, event))

    def _make_room(self, c: int) -> None:
        """Drops free buffers of other classes (largest first) until ``c`` more bytes fit."""
        for other in sorted(self._free, reverse=True):
            bufs = self._free[other]
            while bufs and self.owned_bytes + c > self.capacity_bytes:
                bufs.pop()
                self.owned_bytes -= other
            if not bufs:
                del self._free[other]

    def _lost(self, key: int, c: int) -> None:
        self._finalizers.pop(key, None)
        self.owned_bytes -= c
        self.stats.lost += 1


def carve(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous tensors with the shapes and dtypes of ``like``, laid out back to back in ``buf``."""
    out, off = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[off:off + n].view(t.dtype).view(t.shape))
        off += _aligned(n)
    return out


class PooledKV(PrefixKV):
    """A host copy of a prefix whose tensors are carved out of one pool buffer; :meth:`release` gives it back."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], timestamps: torch.Tensor,
                 ready: Any, pool: HostPool, buf: torch.Tensor) -> None:
        super().__init__(keys, values, timestamps, ready)
        self.pool: HostPool | None = pool
        self.buf = buf

    def release(self) -> None:
        """Nothing reads it any more (dropped from DRAM, or promoted: the copy to the device is queued)."""
        if self.pool is not None:
            self.pool.give(self.buf)
            self.pool = None


def copy_to_host(kv: PrefixKV, pool: HostPool, stream: Any = None) -> PooledKV:
    """``kv`` copied into a pool buffer, synchronously when ``stream`` is None, else on that CUDA side stream
    without blocking the caller (the event loop): the copy waits for the work that produced the tensors, the
    sources stay allocated until it has run (``record_stream``), and :meth:`PrefixKV.to` waits for the
    result's ``ready`` event before reading it."""
    src = [*kv.keys, *kv.values, kv.timestamps]
    buf, wait = pool.take(sum(_aligned(t.numel() * t.element_size()) for t in src))
    dst = carve(buf, src)
    n = len(kv.keys)
    if stream is None:
        with torch.no_grad():
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
        return PooledKV(dst[:n], dst[n:2 * n], dst[-1], None, pool, buf)
    device = kv.device
    stream.wait_stream(torch.cuda.current_stream(device))
    if wait is not None:  # the buffer's last promotion must have read it
        stream.wait_event(wait)
    with torch.cuda.stream(stream):
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    for t in src:
        t.record_stream(stream)
    if isinstance(kv, ArenaKV):  # later work on the compute stream may overwrite the freed range
        torch.cuda.current_stream(device).wait_event(ready)
    return PooledKV(dst[:n], dst[n:2 * n], dst[-1], ready, pool, buf)


def evict_to_host(pool: HostPool, stream: Any = None) -> Callable[[PrefixKV], PrefixKV]:
    """The cache's ``to_host``: device tensors and arena ranges are copied into the pool; a plain prefix
    already in host memory is kept as it is (nobody else holds it, so no copy is needed)."""

    def to_host(kv: PrefixKV) -> PrefixKV:
        if stream is None and not isinstance(kv, ArenaKV) and kv.device.type == "cpu":
            return kv
        return copy_to_host(kv, pool, stream)

    return to_host

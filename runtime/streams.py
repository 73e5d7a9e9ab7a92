"""Device streams for the pipelines: a compute lane and side lanes for communication and copies.

Why: everything a thread enqueues without a stream goes to the device's default stream, in order. A
synchronous NCCL/HCCL All2All issued there waits for every kernel queued before it, and the kernels queued
after it wait for the All2All: communication serialises with compute however the host threads overlap.
Work on a side stream (``comm``: collectives; ``copy``: H2D copies, lookups) runs concurrently with the
compute stream, and ordering is stated explicitly: ``lane.record()`` marks "everything queued on this
lane so far" (an event) and ``other.wait(marker)`` makes later work on ``other`` wait for it on the device,
without blocking the host. A tensor allocated on one lane and used on another is ``keep``-ed there
(``Tensor.record_stream``) so the caching allocator does not hand its memory out again before that lane
is done with it. ProcessGroupNCCL orders a collective after the *current* stream of the issuing thread
and ``work.wait()`` makes the current stream wait for it: issuing inside ``with streams.comm:`` ties the
collective to the comm lane only.

CUDA uses ``torch.cuda.Stream``/``Event``, Ascend ``torch.npu.Stream``/``Event`` (torch_npu mirrors the
CUDA API). The CPU form keeps the same calls and the program order: CPU kernels run synchronously in the
issuing thread, so there is nothing to wait for on a device, and order across threads comes from the
Futures that hand results over. ``record``/``wait``/``keep`` are then no-ops; with ``trace`` (a list) every
call appends ``(lane, op, marker id)``, so a test can check that a pipeline waited on the marker of the
work that produced a tensor before using it. What that proves: the order of the pipeline's records and
waits, and so which work each use is ordered after. What it does not: that the device lanes overlap, or
that the allocator reuses nothing early (``keep``); and since the CPU runs every lane's work synchronously,
a missing wait still gives the right numbers there: only a test asserting the trace catches it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from grstack.runtime.device import npu_available

LANES = ("compute", "comm", "copy")
TraceEntry = tuple[str, str, int | None]  # (lane, op, marker id); op: enter, record, wait, keep

_side_lock = threading.Lock()
_side_streams: dict[tuple[str, int], tuple[Any, Any]] = {}  # (type, index) -> (comm, copy): once per rank


def _backend(device: torch.device) -> ModuleType | None:
    """``torch.cuda`` / ``torch.npu`` (their Stream, Event, current_stream and stream() agree), or None."""
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        if not npu_available():
            raise RuntimeError("npu streams need torch_npu and an Ascend device")
        return torch.npu  # type: ignore[attr-defined]  # added by torch_npu
    return None


@dataclass(frozen=True)
class Marker:
    """A point on a lane: everything queued there before ``record()`` (an event; None on CPU)."""

    id: int
    lane: str
    event: Any = None

    def synchronize(self) -> None:
        """Blocks the host until the marked work is done (a host sync on a device; nothing on CPU)."""
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        """Whether the marked work is done, without blocking (always True on CPU)."""
        return True if self.event is None else bool(self.event.query())


@dataclass(eq=False)
class Lane:
    """One stream of a ``StreamSet``; ``with lane:`` makes it the thread's current stream."""

    name: str
    device: torch.device
    stream: Any  # torch.cuda.Stream / torch.npu.Stream, None on CPU
    owner: StreamSet
    backend: ModuleType | None = None  # torch.cuda / torch.npu
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def __enter__(self) -> Lane:
        self.owner._note(self.name, "enter", None)
        ctx = self.backend.stream(self.stream) if self.backend is not None else None
        if ctx is not None:
            ctx.__enter__()
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(ctx)  # per thread: two threads may be inside the same lane at once
        return self

    def __exit__(self, *exc: object) -> None:
        ctx = self._local.stack.pop()
        if ctx is not None:
            ctx.__exit__(*exc)

    def record(self) -> Marker:
        """A marker of everything queued on this lane so far (from any thread)."""
        event = None
        if self.backend is not None:
            event = self.backend.Event()
            event.record(self.stream)
        marker = Marker(next(self.owner._ids), self.name, event)
        self.owner._note(self.name, "record", marker.id)
        return marker

    def wait(self, marker: Marker | None) -> None:
        """Work queued on this lane from now on waits on the device for ``marker`` (the host does not wait;
        None: nothing to wait for)."""
        self.owner._note(self.name, "wait", None if marker is None else marker.id)
        if marker is not None and marker.event is not None:
            self.stream.wait_event(marker.event)

    def keep(self, *tensors: torch.Tensor | None) -> None:
        """Tells the allocator that this lane uses ``tensors`` (allocated on another lane): their memory is
        not reused before the work queued here when they are freed is done. Host tensors are skipped."""
        self.owner._note(self.name, "keep", None)
        if self.stream is None:
            return
        for t in tensors:
            if t is not None and t.device.type == self.device.type:
                t.record_stream(self.stream)


class StreamSet:
    """The lanes of one device: ``compute`` (the stream current when the set is made, normally the default
    stream), ``comm`` and ``copy`` (side streams, made once per device and shared by every set). With
    ``trace`` every lane call appends (lane, op, marker id), op one of enter, record, wait, keep."""

    def __init__(self, device: torch.device, compute: Any, comm: Any, copy: Any,
                 trace: list[TraceEntry] | None = None) -> None:
        self.device, self.trace = device, trace
        self._ids = itertools.count()
        backend = _backend(device)
        self.compute = Lane("compute", device, compute, self, backend)
        self.comm = Lane("comm", device, comm, self, backend)
        self.copy = Lane("copy", device, copy, self, backend)

    @classmethod
    def for_device(cls, device: torch.device, trace: list[TraceEntry] | None = None) -> StreamSet:
        """The lanes of ``device`` (an index-less cuda/npu device means the current one); on CPU the form
        that keeps program order, tracing every call into ``trace`` when given."""
        backend = _backend(device)
        if backend is None:
            return cls(device, None, None, None, trace)
        index = device.index if device.index is not None else backend.current_device()
        device = torch.device(device.type, index)
        with _side_lock:
            if (device.type, index) not in _side_streams:
                _side_streams[(device.type, index)] = (backend.Stream(device), backend.Stream(device))
            comm, copy = _side_streams[(device.type, index)]
        return cls(device, backend.current_stream(device), comm, copy, trace)

    def lanes(self) -> tuple[Lane, Lane, Lane]:
        return self.compute, self.comm, self.copy

    def _note(self, lane: str, op: str, marker: int | None) -> None:
        if self.trace is not None:
            self.trace.append((lane, op, marker))

"""Collectives on one process group, used by one thread, with time and byte counters.

Each Comm wraps one group, and one thread issues on it (docs of ``grstack.runtime.train.context`` say which),
so collectives of different threads never interleave on one communicator. A group of one rank short-circuits
every collective, which makes a 1-rank job run the same code without a network (unless the job was launched
as a world of one, where ``live`` keeps the collectives: the device check of every collective).

Devices: strict placement. NCCL and HCCL take only tensors on the rank's accelerator; gloo takes CPU tensors.
``Comm`` enforces it and copies nothing between devices: every collective refuses (``ValueError`` naming the
group, the collective, the tensor's device, dtype and shape, and the device the group needs) a tensor that is
not on ``device`` (the group's backend device), before any network call, and returns its results there. A
copy hidden in a collective would hide a misplaced tensor and cost a transfer (a device-to-host read is a
host sync) the caller never sees; callers move tensors themselves, where they can overlap the copy. The only
copy left is ``contiguous()`` (on the same device) of a strided input. Routing metadata (key counts, keys,
sizes) is host data that the host needs anyway (split sizes are Python ints), so it travels on ``meta``: a
gloo group over the same ranks (the group itself when it is gloo). Moving it through an accelerator would
cost a device-to-host sync per collective.

Failures. A collective the backend fails (a peer died, stalled past the group's timeout, or the communicator
was aborted) raises :class:`CollectiveError`, naming the group and the collective, with the backend's error as
its ``cause`` (the launcher turns it into one ``error:`` line and exit status 3). The wait of an async
collective raises the backend's own error.

Communication log. ``attach_log(comms, log)`` makes each Comm (and its ``meta`` twin) append one
``CommEvent`` per collective it issues to a shared ``CommLog``: the op, the group's name and size, the bytes
this rank puts on the wire and receives, the dtype, the seconds the call took in the issuing thread, that
thread's name (the compute thread, ``grstack-comm``, ``grstack-prefetch``), whether it was launched
asynchronously, and the step marker the caller last set (``CommLog.mark``). Off by default: a Comm without a
log pays one ``is None`` test per collective. A collective that short-circuits (a group that is not
``live``) moves nothing and is not logged. Bytes: ``sent`` is what leaves this rank for other members
(All2All: every destination but itself; all-gather: its padded piece once per other member; all-reduce: the
tensor, whatever algorithm the backend runs; barrier and object collectives: 0, their size is not known here),
``recv`` what arrives from other members; ``nbytes`` is the input tensor's size. ``bench simulate``
(docs/simulate.md) extrapolates these events to many workers.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommEvent:
    """One collective as issued by this rank (see the module docstring for what the byte counts mean)."""

    op: str  # all_to_all | exchange | all_gather(_v|_sizes) | all_reduce | barrier | *_object
    group: str  # the Comm's name: world, sparse-fwd, sparse-pre, replica (or a *-meta gloo twin)
    group_size: int
    nbytes: int  # the input tensor (this rank's piece)
    sent: int  # bytes leaving this rank for other members
    recv: int  # bytes arriving from other members
    dtype: str
    seconds: float  # wall time of the call in the issuing thread (async: the launch only)
    thread: str  # the issuing thread's name
    async_op: bool
    step: int | None  # the caller's step marker when the collective was issued
    start: float  # time.perf_counter() at issue (ordering and overlap within a step)
    split: tuple[int, ...] = ()  # All2All: rows sent to each member; all-gather: each member's rows

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CommLog:
    """Events of every Comm attached to it (thread safe: the pipeline's threads issue collectives)."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self.step: int | None = None
        self._lock = threading.Lock()

    def mark(self, step: int | None) -> None:
        """Collectives issued from now on belong to ``step`` (whichever thread issues them)."""
        self.step = step

    def add(self, event: CommEvent) -> None:
        with self._lock:
            self.events.append(event)

    def to_dicts(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e.to_dict() for e in self.events]


def attach_log(comms: list[Comm], log: CommLog | None) -> None:
    """Every Comm of ``comms`` and its ``meta`` twin logs into ``log`` (None: stops logging)."""
    for c in comms:
        c.log = log
        c.meta.log = log


class CollectiveError(RuntimeError):
    """A collective the backend failed (a peer died or stalled past the group's timeout, or the communicator
    was aborted): ``group`` and ``op`` name it, ``cause`` is the backend's error."""

    def __init__(self, group: str, op: str, cause: BaseException) -> None:
        lines = str(cause).strip().splitlines()
        first = lines[0] if lines else type(cause).__name__
        super().__init__(f"{op} on group {group} failed: {first[:300]}")
        self.group, self.op, self.cause = group, op, cause


class _LoggedWork:
    """An async collective's handle while logging: ``wait`` also records a ``wait`` event (0 bytes; its
    seconds are the time the waiting thread was blocked), so the log shows where the issuer waited for it."""

    def __init__(self, work: dist.Work, comm: Comm, t: torch.Tensor) -> None:
        self._work, self._comm, self._t = work, comm, t

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        if self._comm.log is not None:
            self._comm._record("wait", t0, self._t, 0, 0)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Comm:
    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], rank: int, name: str,
                 device: torch.device | None = None, meta: Comm | None = None, live: bool | None = None) -> None:
        self.group, self.ranks, self.name = group, ranks, name
        self.size = len(ranks)
        self.index = ranks.index(rank)
        self.device = device if device is not None else torch.device("cpu")
        self.live = self.size > 1 if live is None else live
        self.meta = meta if meta is not None else self
        if self.meta.device.type != "cpu":
            raise ValueError(f"{name}: the metadata group must be a CPU (gloo) group, not {self.meta.device}")
        self.seconds = 0.0
        self.bytes = 0
        self.log: CommLog | None = None

    def _call(self, what: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, group=..., **kwargs)`` for collective ``what``; a backend failure becomes a
        :class:`CollectiveError`."""
        try:
            return fn(*args, group=kwargs.pop("group", self.group), **kwargs)
        except RuntimeError as exc:  # torch.distributed.DistError is one
            raise CollectiveError(self.name, what, exc) from exc

    def _timed(self, what: str, fn: Any, /, *args: Any, **kwargs: Any) -> float:
        t0 = time.perf_counter()
        self._call(what, fn, *args, **kwargs)
        t1 = time.perf_counter()
        self.seconds += t1 - t0
        return t0

    def _record(self, op: str, t0: float, t: torch.Tensor | None, sent: int, recv: int, *,
                async_op: bool = False, split: tuple[int, ...] = ()) -> None:
        assert self.log is not None
        now = time.perf_counter()
        self.log.add(CommEvent(
            op=op, group=self.name, group_size=self.size,
            nbytes=0 if t is None else t.element_size() * t.numel(), sent=sent, recv=recv,
            dtype="" if t is None else str(t.dtype).removeprefix("torch."), seconds=0.0 if async_op else now - t0,
            thread=threading.current_thread().name, async_op=async_op, step=self.log.step, start=t0,
            split=split))

    def _placed(self, t: torch.Tensor, op: str) -> None:
        """Refuses ``t`` unless it is on this group's device (a device without an index: any of its kind)."""
        d = t.device
        if d.type == self.device.type and (self.device.index is None or d.index == self.device.index):
            return
        dtype = str(t.dtype).removeprefix("torch.")
        raise ValueError(f"{self.name}: {op} of a {dtype} tensor of shape {tuple(t.shape)} on {d}; this group's "
                         f"backend needs {self.device} (Comm copies nothing: move it there before the collective)")

    def _wire(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """``t`` contiguous, after checking it is on the backend's device (the one place tensors enter)."""
        self._placed(t, op)
        return t.contiguous()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Uneven All2All along dim 0: ``send_counts[d]`` rows go to group member d (result on ``device``)."""
        if not self.live:
            return send
        send = self._wire(send, "all_to_all")
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        self.bytes += send.element_size() * send.numel()
        t0 = self._timed("all_to_all", dist.all_to_all_single, out, send, recv_counts, send_counts)
        if self.log is not None:
            row = send.element_size() * math.prod(send.shape[1:])
            me = self.index
            self._record("all_to_all", t0, send, row * (sum(send_counts) - send_counts[me]),
                         row * (sum(recv_counts) - recv_counts[me]), split=tuple(int(c) for c in send_counts))
        return out

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Even All2All of a [size, ...] tensor: row d goes to member d; row s of the result came from s."""
        if not self.live:
            return send
        send = self._wire(send, "exchange")
        out = torch.empty_like(send)
        t0 = self._timed("exchange", dist.all_to_all_single, out, send)
        if self.log is not None:
            other = send.element_size() * send.numel() * (self.size - 1) // self.size
            self._record("exchange", t0, send, other, other)
        return out

    def all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers tensors whose dim 0 differs between members (sizes on ``meta``, data padded on the wire)."""
        if not self.live:
            return [t]
        t = self._wire(t, "all_gather_v")  # checked before the sizes round: nothing is sent for a misplaced one
        sizes = [int(n) for n in self.meta.all_gather_sizes(t.shape[0])]
        width = max(sizes)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]] = t
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.bytes += padded.element_size() * padded.numel()
        t0 = self._timed("all_gather_v", dist.all_gather, outs, padded)
        if self.log is not None:
            piece = padded.element_size() * padded.numel()
            self._record("all_gather_v", t0, padded, piece * (self.size - 1), piece * (self.size - 1),
                         split=tuple(sizes))
        return [o[:s] for o, s in zip(outs, sizes, strict=True)]

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers tensors of one shape from every member (no sizes round: the caller agreed the shape)."""
        if not self.live:
            return [t]
        t = self._wire(t, "all_gather")
        outs = [torch.empty_like(t) for _ in range(self.size)]
        self.bytes += t.element_size() * t.numel()
        t0 = self._timed("all_gather", dist.all_gather, outs, t)
        if self.log is not None:
            piece = t.element_size() * t.numel()
            self._record("all_gather", t0, t, piece * (self.size - 1), piece * (self.size - 1))
        return outs

    def all_gather_sizes(self, n: int) -> list[int]:
        """Every member's ``n`` (a host value, on this group: call it on ``meta``)."""
        if not self.live:
            return [n]
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        t0 = self._timed("all_gather_sizes", dist.all_gather, counts, mine)
        if self.log is not None:
            self._record("all_gather_sizes", t0, mine, 8 * (self.size - 1), 8 * (self.size - 1))
        return [int(c) for c in counts]

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        """In place, so ``t`` must already be on ``device`` (and contiguous: the result lands in ``t``)."""
        if not self.live:
            return None
        self._placed(t, "all_reduce")
        self.bytes += t.element_size() * t.numel()
        n = t.element_size() * t.numel()
        if async_op:
            t0 = time.perf_counter()
            work = self._call("all_reduce", dist.all_reduce, t, op=op, async_op=True)
            if self.log is not None:
                self._record("all_reduce", t0, t, n, n, async_op=True)
                return _LoggedWork(work, self, t)  # type: ignore[return-value]
            return work
        t0 = self._timed("all_reduce", dist.all_reduce, t, op=op)
        if self.log is not None:
            self._record("all_reduce", t0, t, n, n)
        return None

    def barrier(self) -> None:
        if self.live:
            t0 = time.perf_counter()
            self._call("barrier", dist.barrier, group=self.meta.group)
            self.seconds += time.perf_counter() - t0
            if self.log is not None:
                self._record("barrier", t0, None, 0, 0)

    def broadcast_object(self, obj: object, src_index: int = 0) -> object:
        if not self.live:
            return obj
        box = [obj]
        t0 = time.perf_counter()
        self._call("broadcast_object", dist.broadcast_object_list, box, src=self.ranks[src_index],
                   group=self.meta.group)
        if self.log is not None:
            self._record("broadcast_object", t0, None, 0, 0)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        if not self.live:
            return [obj]
        out: list[object] = [None] * self.size
        t0 = time.perf_counter()
        self._call("all_gather_object", dist.all_gather_object, out, obj, group=self.meta.group)
        if self.log is not None:
            self._record("all_gather_object", t0, None, 0, 0)
        return out

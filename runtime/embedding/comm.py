"""Collectives on one process group, used by one thread, with time and byte counters.

Each pipeline thread owns its own group (gloo runs the collectives of different groups independently), so a
background lookup never interleaves with the compute thread's collectives. A group of one rank short-circuits
every collective, which makes a 1-rank job run the same code without a network (unless the job was launched
as a world of one, where ``live`` keeps the collectives: the device check of every collective).

Devices. NCCL and HCCL take only tensors on the rank's accelerator; gloo takes CPU tensors. ``Comm`` is where
this is enforced: every out-of-place collective moves its input to ``device`` (the group's backend device)
and returns its result there, and an in-place one (``all_reduce``) refuses a tensor on another device.
Routing metadata (key counts, keys, sizes) is host data that the host needs anyway (split sizes are Python
ints), so it travels on ``meta``: a gloo group over the same ranks (the group itself when it is gloo). Moving
it through an accelerator would cost a device-to-host sync per collective.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


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

    def _timed(self, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        fn(*args, group=self.group, **kwargs)
        self.seconds += time.perf_counter() - t0

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the backend's device, contiguous (the one place tensors enter a collective)."""
        if t.device != self.device:
            t = t.to(self.device, non_blocking=True)
        return t.contiguous()

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Uneven All2All along dim 0: ``send_counts[d]`` rows go to group member d (result on ``device``)."""
        if not self.live:
            return send
        send = self._wire(send)
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        self.bytes += send.element_size() * send.numel()
        self._timed(dist.all_to_all_single, out, send, recv_counts, send_counts)
        return out

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Even All2All of a [size, ...] tensor: row d goes to member d; row s of the result came from s."""
        if not self.live:
            return send
        send = self._wire(send)
        out = torch.empty_like(send)
        self._timed(dist.all_to_all_single, out, send)
        return out

    def all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers tensors whose dim 0 differs between members (sizes on ``meta``, data padded on the wire)."""
        if not self.live:
            return [t]
        sizes = [int(n) for n in self.meta.all_gather_sizes(t.shape[0])]
        width = max(sizes)
        t = self._wire(t)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]] = t
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.bytes += padded.element_size() * padded.numel()
        self._timed(dist.all_gather, outs, padded)
        return [o[:s] for o, s in zip(outs, sizes, strict=True)]

    def all_gather_sizes(self, n: int) -> list[int]:
        """Every member's ``n`` (a host value, on this group: call it on ``meta``)."""
        if not self.live:
            return [n]
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._timed(dist.all_gather, counts, mine)
        return [int(c) for c in counts]

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        """In place, so ``t`` must already be on ``device`` (a tensor elsewhere is a bug: it is refused)."""
        if not self.live:
            return None
        if t.device != self.device:
            raise ValueError(f"{self.name}: all_reduce of a tensor on {t.device}; this group's backend needs "
                             f"{self.device}")
        self.bytes += t.element_size() * t.numel()
        if async_op:
            return dist.all_reduce(t, op=op, group=self.group, async_op=True)
        self._timed(dist.all_reduce, t, op=op)
        return None

    def barrier(self) -> None:
        if self.live:
            t0 = time.perf_counter()
            dist.barrier(group=self.meta.group)
            self.seconds += time.perf_counter() - t0

    def broadcast_object(self, obj: object, src_index: int = 0) -> object:
        if not self.live:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src_index], group=self.meta.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        if not self.live:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.meta.group)
        return out

"""Collectives on one process group, used by one thread, with time and byte counters.

Each pipeline thread owns its own group (gloo runs the collectives of different groups independently), so a
background lookup never interleaves with the compute thread's collectives. A group of one rank short-circuits
every collective, which makes a 1-rank job run the same code without a network.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class Comm:
    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], rank: int, name: str) -> None:
        self.group, self.ranks, self.name = group, ranks, name
        self.size = len(ranks)
        self.index = ranks.index(rank)
        self.seconds = 0.0
        self.bytes = 0

    def _timed(self, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        fn(*args, group=self.group, **kwargs)
        self.seconds += time.perf_counter() - t0

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Uneven All2All along dim 0: ``send_counts[d]`` rows go to group member d."""
        if self.size == 1:
            return send
        out = send.new_empty((sum(recv_counts), *send.shape[1:]))
        self.bytes += send.element_size() * send.numel()
        self._timed(dist.all_to_all_single, out, send.contiguous(), recv_counts, send_counts)
        return out

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Even All2All of a [size, ...] tensor: row d goes to member d; row s of the result came from s."""
        if self.size == 1:
            return send
        out = torch.empty_like(send)
        self._timed(dist.all_to_all_single, out, send.contiguous())
        return out

    def all_gather_v(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Gathers tensors whose dim 0 differs between members (padded on the wire)."""
        if self.size == 1:
            return [t]
        n = torch.tensor([t.shape[0]], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._timed(dist.all_gather, counts, n)
        sizes = [int(c) for c in counts]
        width = max(sizes)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]] = t
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.bytes += padded.element_size() * padded.numel()
        self._timed(dist.all_gather, outs, padded)
        return [o[:s] for o, s in zip(outs, sizes, strict=True)]

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        if self.size == 1:
            return None
        self.bytes += t.element_size() * t.numel()
        if async_op:
            return dist.all_reduce(t, op=op, group=self.group, async_op=True)
        self._timed(dist.all_reduce, t, op=op)
        return None

    def barrier(self) -> None:
        if self.size > 1:
            self._timed(dist.barrier)

    def broadcast_object(self, obj: object, src_index: int = 0) -> object:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src_index], group=self.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        if self.size == 1:
            return [obj]
        out: list[object] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

"""The dense gradients' all-reduce, bucketed and overlapped with backward (as DDP's reducer does).

Why not ``DistributedDataParallel``: the engine's collectives are all issued by one thread per rank in
program order (``grstack-comm``), the dense module shares its backward with the sparse path's leaf rows,
and an accumulation window spans several batches; DDP issues from the autograd thread on its own process
group and ties ``no_sync`` to a context manager. The bucketing here is DDP's: buckets of about
``bucket_bytes`` per dtype, in reverse parameter order (backward produces the last layers' gradients first).

Gradients live in the buckets (DDP's ``gradient_as_bucket_view``): ``p.grad`` is a view into its bucket's
flat buffer, autograd accumulates into it in place, the all-reduce runs on the buffer and the optimizer
reads the sums through the same views; nothing is copied per step.

One accumulation window::

    reducer.start_window()        # zeroes the buckets, points every p.grad at its view (not zero_grad)
    loss_1.backward() ...         # earlier micro-batches: gradients accumulate, nothing is launched
    reducer.arm()
    loss_n.backward()             # a bucket whose gradients are all final launches its all-reduce
    reducer.flush()               # right after that backward: launches every bucket not launched yet
    ...                           # other work (the sparse update) overlaps the all-reduces
    reducer.wait()                # the sums are in p.grad; unreached parameters get grad None
    optimizer.step()

A tail (``tail=n``): the last bucket gets ``n`` more elements after its gradients and is held back from the
hooks and ``flush`` until ``release(values)`` writes ``values`` there and launches it, so a step's other
sums (its stats) ride along with the dense gradients instead of costing a collective of their own; ``tail``
reads the sums after ``wait``. The held bucket is the one backward fills last (the input-side layers), so
holding it gives up little overlap; the caller releases it once those values exist (the engine: after the
sparse gradients' All2All, which the sparse update needs first). With ``tail_dtype``, a last bucket of another
dtype gets no tail (``tail`` is None: the caller sums its values apart).

Order. Buckets launch strictly in index order (bucket i after every bucket below i), through ``submit``
(the rank's single collective-issuing thread), so every rank issues the same all-reduces in the same order
even where a parameter that one rank's loss did not reach holds its bucket back until ``flush``.

Streams. With ``lanes`` (a ``grstack.runtime.streams.StreamSet``) a launch records a marker on the compute
lane when the bucket is ready; the issuing thread runs the all-reduce under the comm lane after that lane
waits for the marker (a device-side wait, no host block), and keeps the buffer alive for it. ``wait`` then
orders the caller's current stream after each all-reduce (``Work.wait``; gloo blocks the host instead).

Limits: one backward per ``arm``; no ``create_graph`` (autograd would then replace ``p.grad`` instead of
accumulating into it, which the hook detects and refuses); scaling, clipping and autocast are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from grstack.runtime.embedding import Comm

if TYPE_CHECKING:
    from grstack.runtime.streams import Marker, StreamSet

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket: walked in reverse order, one open bucket per dtype, closed once adding
    the next parameter would pass ``bucket_bytes`` (a larger parameter gets a bucket of its own). Buckets are
    ordered by the reverse position of their first parameter, which is the order backward fills them."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    done: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        n = p.numel() * p.element_size()
        members, size = open_.get(p.dtype, ([], 0))
        if members and size + n > bucket_bytes:
            done.append(members)
            members, size = [], 0
        open_[p.dtype] = ([*members, i], size + n)
    done.extend(members for members, _ in open_.values() if members)
    return sorted(done, key=lambda b: -b[0])


@dataclass
class _Bucket:
    params: list[int]  # indices into the reducer's parameters, in bucket order
    buffer: torch.Tensor  # flat, one dtype
    views: list[torch.Tensor]  # views[k] is params[k]'s gradient

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class BucketedAllReduce:
    """Sums the dense gradients over ``comm``'s ranks, bucket by bucket as backward produces them.

    ``submit(fn, *args) -> Future`` runs ``fn`` on the rank's collective-issuing thread; the Future's result
    is the async ``Work`` (None where the group short-circuits). A ``comm`` that is not live makes every
    collective a no-op: the reducer then only zeroes the buffers and keeps ``p.grad`` a view.

    Hooks run in autograd's thread (on an accelerator, its device thread) while the caller is inside
    ``backward()``; the caller's thread touches the state only between backward passes, so no lock."""

    def __init__(self, params: Iterable[nn.Parameter], comm: Comm, submit: Callable[..., Future[Any]],
                 lanes: StreamSet | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, tail: int = 0,
                 tail_dtype: torch.dtype | None = None) -> None:
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            unique.setdefault(id(p), p)
        self.params = list(unique.values())
        for p in self.params:
            if not p.requires_grad:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} does not require grad")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"dense parameters on several devices: {sorted(map(str, devices))}")
        if comm.live and devices and devices != {comm.device}:
            raise ValueError(f"{comm.name}: dense parameters on {next(iter(devices))}; this group's backend "
                             f"needs {comm.device}")
        self.comm, self._submit, self.lanes = comm, submit, lanes
        self._buckets: list[_Bucket] = []
        self._bucket_of = [0] * len(self.params)
        self._view_of: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
        if tail < 0:
            raise ValueError(f"tail must be non-negative, not {tail}")
        groups = assign_buckets(self.params, bucket_bytes)
        if tail and not groups:
            raise ValueError("a tail needs at least one bucket (no parameters)")
        if tail_dtype is not None and groups and self.params[groups[-1][0]].dtype != tail_dtype:
            tail = 0  # the values need another dtype than the last bucket's: no tail (the caller sums them apart)
        for b, members in enumerate(groups):
            first = self.params[members[0]]
            extra = tail if b == len(groups) - 1 else 0
            buffer = torch.zeros(sum(self.params[i].numel() for i in members) + extra, dtype=first.dtype,
                                 device=first.device)
            views, at = [], 0
            for i in members:
                p = self.params[i]
                views.append(buffer[at : at + p.numel()].view(p.shape))
                self._bucket_of[i], self._view_of[i] = b, views[-1]
                at += p.numel()
            self._buckets.append(_Bucket(members, buffer, views))
        self._tail = self._buckets[-1].buffer[self._buckets[-1].buffer.numel() - tail :] if tail else None
        # launches by the hooks and flush stop before the held bucket (the last) while it waits for release
        self._stop = len(self._buckets) - (1 if tail else 0)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self.launched_in_backward = 0  # all-reduces launched by a hook, inside backward (totals since creation)
        self.launched_at_flush = 0  # all-reduces launched by flush, after backward returned
        self._open = self._armed = self._flushed = False
        self._reached = [False] * len(self.params)  # by any backward of the window
        self._armed_seen = [False] * len(self.params)  # by the armed backward
        self._missing = [0] * len(self._buckets)
        self._next = 0  # the next bucket to launch
        self._futures: list[Future[Any]] = []

    @property
    def buckets(self) -> list[int]:
        """Each bucket's size in bytes, in launch order."""
        return [b.nbytes for b in self._buckets]

    @property
    def tail(self) -> torch.Tensor | None:
        """The tail's elements (after ``wait``: summed over the ranks); None without a tail."""
        return self._tail

    @property
    def tail_dtype(self) -> torch.dtype | None:
        return self._tail.dtype if self._tail is not None else None

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers the gradients live in, in launch order."""
        return [b.buffer for b in self._buckets]

    def start_window(self) -> None:
        """Zeroes the buckets and points every ``p.grad`` at its view (the optimizer's zero_grad, without
        freeing anything): the first backward of an accumulation window follows."""
        if self._futures:
            raise RuntimeError("start_window() before wait() of the previous window")
        for b in self._buckets:
            b.buffer.zero_()
            for i, view in zip(b.params, b.views, strict=True):
                self.params[i].grad = view
        self._open, self._armed, self._flushed = True, False, False
        self._reached = [False] * len(self.params)
        self._armed_seen = [False] * len(self.params)
        self._missing = [len(b.params) for b in self._buckets]
        self._next = 0

    def arm(self) -> None:
        """The next backward ends the window: its hooks launch each bucket as soon as it is complete."""
        if not self._open or self._flushed:
            raise RuntimeError("arm() outside a window: call start_window() first")
        self._armed = True

    def flush(self) -> None:
        """Launches every bucket not launched yet, in bucket order (call right after the armed backward),
        except a held one (see ``release``)."""
        if not self._open:
            raise RuntimeError("flush() outside a window: call start_window() first")
        self._armed, self._flushed = False, True
        while self._next < self._stop:
            self._launch(in_backward=False)

    def release(self, values: torch.Tensor | None = None) -> None:
        """Writes ``values`` (flat, ``tail`` elements) into the held bucket's tail and launches it, after
        every other bucket (flushing them first if needed). Without a tail: the same as ``flush``."""
        if not self._open:
            raise RuntimeError("release() outside a window: call start_window() first")
        if not self._flushed:
            self.flush()
        if values is not None:
            if self._tail is None:
                raise RuntimeError("release(values) on a reducer without a tail")
            if values.numel() != self._tail.numel():
                raise ValueError(f"{values.numel()} values for a tail of {self._tail.numel()}")
            self._tail.copy_(values.reshape(-1))
        while self._next < len(self._buckets):
            self._launch(in_backward=False)

    def wait(self) -> None:
        """Waits for every launched all-reduce (flushing first if needed); afterwards a parameter that no
        backward of the window reached on this rank has grad None (AdamW then skips it, as without buckets)."""
        if not self._open:
            raise RuntimeError("wait() outside a window: call start_window() first")
        self.release()  # launches what is left (a held bucket with its tail as it is)
        futures, self._futures = self._futures, []
        for fut in futures:
            work = fut.result()
            if work is not None:
                work.wait()
        for i, p in enumerate(self.params):
            if not self._reached[i]:
                p.grad = None
        self._open = False

    def close(self) -> None:
        """Removes the hooks (the parameters keep their last gradients)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            self._on_grad(i, p)
        return on_grad

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._open or self._flushed:
            raise RuntimeError("a backward outside an open window: call start_window() (and not after flush())")
        grad = p.grad
        if grad is None or grad.data_ptr() != self._view_of[i].data_ptr():
            raise RuntimeError("a parameter's .grad is no longer its bucket view (zero_grad(set_to_none=True), "
                               "a .grad assignment or create_graph=True replaced it)")
        self._reached[i] = True
        if not self._armed:
            return
        if self._armed_seen[i]:
            raise RuntimeError("a second backward after arm(): one backward per arm()")
        self._armed_seen[i] = True
        b = self._bucket_of[i]
        self._missing[b] -= 1
        while self._next < self._stop and self._missing[self._next] == 0:
            self._launch(in_backward=True)

    def _launch(self, in_backward: bool) -> None:
        bucket = self._buckets[self._next]
        self._next += 1
        if not self.comm.live:
            return
        marker = self.lanes.compute.record() if self.lanes is not None else None
        self._futures.append(self._submit(self._issue, bucket.buffer, marker))
        if in_backward:
            self.launched_in_backward += 1
        else:
            self.launched_at_flush += 1

    def _issue(self, buffer: torch.Tensor, marker: Marker | None) -> Any:
        """Runs on the issuing thread: the bucket's async all-reduce, on the comm lane after the marker."""
        if self.lanes is None:
            return self.comm.all_reduce(buffer, async_op=True)
        with self.lanes.comm:
            self.lanes.comm.wait(marker)
            self.lanes.comm.keep(buffer)
            return self.comm.all_reduce(buffer, async_op=True)

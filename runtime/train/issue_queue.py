"""The rank's one collective-issuing thread, ``grstack-comm``: a FIFO queue of collectives.

Why: NCCL and HCCL require every rank to issue the operations of its communicators in one order; two
threads that each issue collectives (on one communicator or on several) interleave differently on each rank
and can deadlock. So every collective on a device communicator (world, sparse-fwd, replica) is submitted
here and issued by one thread, in submission order. Work is submitted only from the main (training) thread,
or from autograd hooks while the main thread is blocked inside ``backward()`` (the dense buckets): the
submission order is then the program order, which is the same on every rank. The prefetch thread keeps only
host work (routing on the gloo ``sparse-pre`` group, the retrieve of the shard's rows).

Jobs run under the comm lane of ``lanes`` (``grstack.runtime.streams``): a collective issued there is
ordered after the comm lane's earlier work only; a job orders itself after other lanes with
``lanes.comm.wait(marker)``. A job that raises fails its Future only; later jobs still run.

A job whose collectives all short-circuit (a one-rank job without a process group) needs no thread: the
issuer then runs each job at once in the caller's thread (the program order as well).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from grstack.runtime.device import set_current_device

if TYPE_CHECKING:
    from grstack.runtime.streams import StreamSet

THREAD_NAME = "grstack-comm"
_Job = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class CollectiveIssuer:
    """``submit(fn, *args) -> Future``: ``fn(*args)`` runs on the issuing thread after every job submitted
    before it. ``threaded=False``: inline in the caller (nothing to overlap, nothing to order)."""

    def __init__(self, device: torch.device, lanes: StreamSet | None = None, threaded: bool = True) -> None:
        self.device, self.lanes, self.threaded = device, lanes, threaded
        self.submitted = 0  # jobs submitted so far (the issue order's length)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        if threaded:
            self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError("submit() after close(): the issuing thread has stopped")
        fut: Future = Future()
        self.submitted += 1
        if self._thread is None:
            self._run(fut, fn, args)
        else:
            self._queue.put((fut, fn, args))
        return fut

    def drain(self) -> None:
        """Returns once every job submitted so far has run (a marker job behind them)."""
        if self._thread is not None and not self._closed:
            self.submit(lambda: None).result()

    def close(self) -> None:
        """Stops the thread after the jobs already queued; later submissions are refused."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if self.lanes is None:
                out = fn(*args)
            else:
                with self.lanes.comm:
                    out = fn(*args)
        except BaseException as exc:  # the submitter's Future carries it
            fut.set_exception(exc)
        else:
            fut.set_result(out)

    def _work(self) -> None:
        set_current_device(self.device)  # NCCL/HCCL calls without an index use the thread's device
        while (job := self._queue.get()) is not None:
            self._run(*job)

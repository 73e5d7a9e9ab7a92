"""The collective issuer runs every job on one thread, in submission order, and keeps going after a failure."""

import threading

import pytest
import torch

from grstack.runtime.streams import StreamSet
from grstack.runtime.train.issue_queue import THREAD_NAME, CollectiveIssuer

pytestmark = pytest.mark.unit


def test_jobs_run_on_one_named_thread_in_submission_order():
    issuer = CollectiveIssuer(torch.device("cpu"))
    gate = threading.Event()
    seen: list[tuple[int, str]] = []
    try:
        first = issuer.submit(gate.wait, 5.0)  # holds the queue: later jobs wait behind it
        futures = [issuer.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
                   for i in range(20)]
        assert not futures[0].done()
        gate.set()
        assert [f.result(5.0) for f in futures] == list(range(20))
        assert first.result(5.0) is True
        assert seen == [(i, THREAD_NAME) for i in range(20)]
        assert issuer.submitted == 21
    finally:
        issuer.close()


def test_a_failing_job_fails_its_future_only():
    issuer = CollectiveIssuer(torch.device("cpu"))
    try:
        bad = issuer.submit(lambda: 1 / 0)
        good = issuer.submit(lambda: 7)
        with pytest.raises(ZeroDivisionError):
            bad.result(5.0)
        assert good.result(5.0) == 7
        issuer.drain()
    finally:
        issuer.close()
    with pytest.raises(RuntimeError, match="after close"):
        issuer.submit(lambda: None)


def test_inline_issuer_runs_in_the_callers_thread_under_the_comm_lane():
    trace: list = []
    issuer = CollectiveIssuer(torch.device("cpu"), StreamSet.for_device(torch.device("cpu"), trace=trace),
                              threaded=False)
    fut = issuer.submit(lambda: threading.current_thread().name)
    assert fut.done() and fut.result() == threading.current_thread().name
    assert trace == [("comm", "enter", None)]
    with pytest.raises(ValueError):
        issuer.submit(int, "x").result()
    issuer.close()

"""The stream layer: the CPU form keeps program order and traces its calls; on CUDA a marker orders a
side-stream copy after the compute that produced its input."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from grstack.runtime.streams import LANES, Marker, StreamSet

pytestmark = pytest.mark.unit

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cpu_form_has_the_three_lanes_and_no_streams():
    s = StreamSet.for_device(torch.device("cpu"))
    assert tuple(lane.name for lane in s.lanes()) == LANES
    assert all(lane.stream is None for lane in s.lanes())
    with s.comm as lane:
        assert lane is s.comm
        x = torch.arange(4) * 2  # runs at once, in this thread
    m = s.comm.record()
    s.compute.wait(m)
    s.compute.wait(None)
    s.compute.keep(x, None)
    assert isinstance(m, Marker) and m.lane == "comm" and m.query()
    m.synchronize()
    assert x.tolist() == [0, 2, 4, 6]


def test_markers_are_numbered_in_order_across_lanes():
    s = StreamSet.for_device(torch.device("cpu"))
    ids = [s.copy.record().id, s.comm.record().id, s.compute.record().id, s.copy.record().id]
    assert ids == [0, 1, 2, 3]


def test_every_call_is_traced_in_program_order():
    trace: list = []
    s = StreamSet.for_device(torch.device("cpu"), trace=trace)
    with s.copy:
        staged = torch.ones(3)
    ready = s.copy.record()
    s.compute.wait(ready)
    with s.compute:
        s.compute.keep(staged)
        _ = staged + 1
    s.comm.wait(None)
    assert trace == [("copy", "enter", None), ("copy", "record", ready.id), ("compute", "wait", ready.id),
                     ("compute", "enter", None), ("compute", "keep", None), ("comm", "wait", None)]


def test_the_trace_shows_a_wait_on_the_marker_of_work_done_in_another_thread():
    """The pattern a pipeline uses: a side thread produces a tensor on the copy lane and hands it over with
    its marker; the consumer waits on that marker before it uses the tensor."""
    trace: list = []
    s = StreamSet.for_device(torch.device("cpu"), trace=trace)

    def produce() -> tuple[torch.Tensor, Marker]:
        with s.copy:
            t = torch.full((4,), 7.0)
        return t, s.copy.record()

    with ThreadPoolExecutor(1) as pool:
        t, marker = pool.submit(produce).result()
    s.compute.wait(marker)
    with s.compute:
        s.compute.keep(t)
        total = t.sum()
    assert total.item() == 28.0
    recorded = trace.index(("copy", "record", marker.id))
    waited = trace.index(("compute", "wait", marker.id))
    used = trace.index(("compute", "enter", None))
    assert recorded < waited < used


def test_a_lane_can_be_entered_by_two_threads_and_nested():
    s = StreamSet.for_device(torch.device("cpu"))
    inside = threading.Barrier(2)
    errors: list[BaseException] = []

    def enter_twice() -> None:
        try:
            with s.comm, s.comm:
                inside.wait(timeout=10)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=enter_twice) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@cuda
def test_cuda_lanes_are_the_current_stream_and_side_streams_made_once():
    dev = torch.device("cuda", torch.cuda.current_device())
    a, b = StreamSet.for_device(torch.device("cuda")), StreamSet.for_device(dev)
    assert a.compute.stream == torch.cuda.current_stream(dev)
    assert a.comm.stream is b.comm.stream and a.copy.stream is b.copy.stream
    assert a.comm.stream != a.compute.stream and a.copy.stream not in (a.compute.stream, a.comm.stream)
    with a.copy:
        assert torch.cuda.current_stream(dev) == a.copy.stream
    assert torch.cuda.current_stream(dev) == a.compute.stream


@cuda
def test_a_side_stream_copy_waits_for_the_marker_of_the_compute_that_wrote_its_input():
    s = StreamSet.for_device(torch.device("cuda"))
    trace: list = []
    s.trace = trace
    with s.compute:
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(50_000_000)  # the compute stream is busy well past the copy's enqueue
        x.fill_(3.0)
    written = s.compute.record()
    with s.copy:
        s.copy.wait(written)
        s.copy.keep(x)
        y = x * 2  # allocated on the copy stream, after the fill on the device
    copied = s.copy.record()
    s.compute.wait(copied)
    with s.compute:
        s.compute.keep(y)
        total = y.sum()
    copied.synchronize()
    assert copied.query()
    assert torch.equal(y, torch.full_like(x, 6.0))
    assert total.item() == 6.0 * (1 << 20)
    assert ("copy", "wait", written.id) in trace and ("compute", "wait", copied.id) in trace

"""Host-sync counters: CUDA's sync debug mode on CUDA, explicit host reads of one thread elsewhere."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from grstack.runtime.device import ExplicitHostReads, HostSyncCounter, host_sync_counter

pytestmark = pytest.mark.unit

NAMES = ("cpu", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero")


def _state() -> dict[str, object]:
    return {**{n: vars(torch.Tensor).get(n, getattr(torch.Tensor, n)) for n in NAMES}, "torch.nonzero": torch.nonzero,
            "own": sorted(n for n in NAMES if n in vars(torch.Tensor))}


def test_each_explicit_read_is_counted_once():
    t, one = torch.tensor([0.0, 2.0, 3.0]), torch.tensor(3)
    with ExplicitHostReads() as c:
        t.cpu()
        t[1].item()
        t.tolist()
        int(one)
        float(one)
        bool(one)
        [10, 20, 30, 40][one]  # __index__
        t.nonzero()
        torch.nonzero(t)
        _ = t * 2 + 1  # device work reads nothing
    assert c.count == 9


def test_the_patched_methods_are_restored_on_exit_even_after_an_error():
    before = _state()
    with pytest.raises(ValueError), ExplicitHostReads():
        assert _state() != before
        raise ValueError("boom")
    assert _state() == before
    with ExplicitHostReads() as c:
        pass
    assert _state() == before and c.count == 0
    torch.ones(2).tolist()  # still works, uncounted
    assert c.count == 0


def test_nested_counters_both_count_and_restore_at_the_last_exit():
    before = _state()
    with ExplicitHostReads() as outer:
        torch.ones(1).item()
        with ExplicitHostReads() as inner:
            torch.ones(1).item()
        assert _state() != before  # the outer one is still active
        torch.ones(1).item()
    assert (outer.count, inner.count) == (3, 1)
    assert _state() == before


def test_reads_of_other_threads_are_not_counted():
    go, done = threading.Event(), threading.Event()

    def other() -> None:
        go.wait(timeout=10)
        for _ in range(5):
            torch.ones(2).tolist()
            int(torch.tensor(1))
        done.set()

    worker = threading.Thread(target=other)
    worker.start()
    with ExplicitHostReads() as c:
        go.set()
        assert done.wait(timeout=10)
        torch.ones(1).item()
    worker.join()
    assert c.count == 1


def test_another_threads_counter_counts_its_own_thread_only():
    counts: dict[str, int] = {}
    ready, release = threading.Barrier(2), threading.Event()

    def other() -> None:
        with ExplicitHostReads() as c:
            ready.wait(timeout=10)
            torch.ones(1).item()
            release.wait(timeout=10)
        counts["other"] = c.count

    worker = threading.Thread(target=other)
    worker.start()
    with ExplicitHostReads() as mine:
        ready.wait(timeout=10)
        torch.ones(3).tolist()
        torch.ones(3).tolist()
        release.set()
        worker.join()  # the other counter exits first: the methods stay patched for this one
        torch.ones(1).item()
    assert (mine.count, counts["other"]) == (3, 1)
    assert _state()["own"] == []


def test_the_counter_of_each_device_names_what_it_counts():
    cpu = host_sync_counter(torch.device("cpu"))
    assert isinstance(cpu, ExplicitHostReads) and cpu.counter.startswith("explicit-host-reads")
    assert "CPU has no device to wait for" in cpu.counter
    npu = SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    assert "explicit-host-reads" in host_sync_counter(npu).counter  # type: ignore[arg-type]
    cuda = host_sync_counter(torch.device("cuda"))
    assert isinstance(cuda, HostSyncCounter) and cuda.counter == "cuda-sync-debug-mode"


def test_the_cuda_counter_reports_nothing_on_cpu():
    with HostSyncCounter(torch.device("cpu")) as c:
        torch.ones(3).sum().item()
    assert c.count is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_counter_counts_a_device_read():
    x = torch.ones(4, device="cuda")
    with host_sync_counter(x.device) as c:
        x.sum().item()
    assert c.count is not None and c.count >= 1

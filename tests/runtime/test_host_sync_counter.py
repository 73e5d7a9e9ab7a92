"""``device.host_sync_counter``: CUDA's sync debug mode on CUDA, the kernels' dispatch-level counter elsewhere
(what that counter sees is tested in tests/kernels/test_host_syncs.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from grstack.kernels import HOST_SYNC_METHOD, HostSyncCount
from grstack.runtime.device import HostSyncCounter, host_sync_counter

pytestmark = pytest.mark.unit


def test_the_counter_of_each_device_names_what_it_counts():
    cpu = host_sync_counter(torch.device("cpu"))
    assert isinstance(cpu, HostSyncCount) and cpu.counter == HOST_SYNC_METHOD
    assert "upper bound" in cpu.counter
    cuda = host_sync_counter(torch.device("cuda"))
    assert isinstance(cuda, HostSyncCounter) and cuda.counter == "cuda-sync-debug-mode"


def test_the_cpu_counter_counts_the_entering_thread_only():
    def elsewhere() -> None:
        torch.ones(2).tolist()
        torch.ones(1).item()

    with host_sync_counter(torch.device("cpu")) as c:
        torch.ones(1).item()
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        int(torch.tensor(3))
    assert c.count == 2


def test_counters_nest_and_both_see_an_inner_read():
    with host_sync_counter(torch.device("cpu")) as outer:
        torch.ones(1).item()
        with host_sync_counter(torch.device("cpu")) as inner:
            torch.ones(3).tolist()
    assert (outer.count, inner.count) == (2, 1)


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

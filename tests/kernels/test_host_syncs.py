"""The host-sync counter sees the implicit syncs (scalar conversions, bool masks, data-dependent shapes) that a
count of ``.cpu/.item/.tolist`` calls misses, and nothing else."""

from __future__ import annotations

import threading

import pytest
import torch

from grstack.kernels import AttentionInputs, triton_hstu
from grstack.kernels.host_syncs import METHOD, HostSyncCount, count_host_syncs

pytestmark = pytest.mark.unit


def test_each_kind_of_sync_is_counted_once():
    t = torch.tensor([0.0, 2.0, 3.0])
    one = torch.tensor(3)
    mask = t > 1
    with HostSyncCount("cpu") as c:
        t.cpu()
        t.tolist()
        t.numpy()
        t[1].item()
        int(one)
        float(one)
        bool(one)
        [10, 20, 30, 40][one]  # __index__
        t.nonzero()
        t[mask]  # bool-mask index -> nonzero
        t.masked_select(mask)
        torch.unique(t)
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert dict(c.by_kind) == {"cpu": 1, "tolist": 1, "numpy": 1, "item": 5, "nonzero": 1, "bool_index": 1,
                               "masked_select": 1, "unique": 1, "repeat_interleave": 1}
    assert c.count == 13


def test_work_with_host_known_sizes_is_not_counted():
    t = torch.arange(6.0)
    with HostSyncCount("cpu") as c:
        t * 2 + 1
        t[torch.tensor([0, 2])]  # integer index
        t.index_select(0, torch.tensor([1]))
        torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([2, 1]), output_size=3)
        torch.where(t > 2, t, 0)
    assert c.count == 0


def test_only_the_counting_device_and_thread_count():
    with HostSyncCount("cuda") as c:  # CPU tensors are host data on a CUDA run
        torch.ones(2).tolist()
        int(torch.tensor(1))
    assert c.count == 0
    with HostSyncCount("cpu") as c:
        worker = threading.Thread(target=lambda: torch.ones(2).tolist())
        worker.start()
        worker.join()
    assert c.count == 0


def test_methods_are_restored_even_after_an_error():
    before = (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy)
    with pytest.raises(RuntimeError), HostSyncCount("cpu"):
        raise RuntimeError("boom")
    assert (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy) == before
    assert count_host_syncs(lambda: torch.ones(1).item()) == 1
    assert "TorchDispatchMode" in METHOD


def test_an_interpreted_kernel_launch_counts_nothing_and_the_triton_path_syncs_nowhere(jagged_case):
    """The interpreter copies every argument to the host; a device launch does not wait, and neither does the
    fused forward+backward (tile lists are built on the device)."""
    case = jagged_case([20, 3, 9], 2, 16, 16, seed=0)
    leaves = [t.clone().requires_grad_() for t in (case.q, case.k, case.v, case.pos_weight, case.time_weight)]
    with HostSyncCount("cpu") as c:
        out = triton_hstu.hstu_attention_triton(AttentionInputs(
            *leaves[:3], case.offsets, max_seq_len=case.max_seq_len, timestamps=case.timestamps,
            pos_weight=leaves[3], time_weight=leaves[4], num_targets=case.num_targets))
        out.sum().backward()
    assert c.count == 0, dict(c.by_kind)
    assert all(t.grad is not None for t in leaves)

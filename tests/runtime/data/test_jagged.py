"""JaggedBatch's host lengths: derived once on the host, carried to a device, never read back from it.

The ``meta`` device stands for an accelerator here: its tensors have shapes and no data, so any read of the
offsets (a host sync on a real device) raises.
"""

import dataclasses

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset

from grstack import kernels
from grstack.runtime.data import LeaveOneOut
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.jagged import JaggedBatch

pytestmark = pytest.mark.unit


def _batch(lengths: list[int]) -> JaggedBatch:
    offsets = kernels.lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    n = sum(lengths)
    return JaggedBatch(item_ids=torch.arange(1, n + 1), offsets=offsets, timestamps=torch.arange(n))


def test_host_lengths_come_from_host_offsets_and_ride_along_to_a_device_and_back():
    batch = _batch([5, 1, 0, 3])
    assert batch.host_lengths == (5, 1, 0, 3)
    on_device = batch.to("meta")
    assert on_device.offsets.device.type == "meta" and on_device.host_lengths == (5, 1, 0, 3)
    back = batch.to("cpu")
    assert back.host_lengths == (5, 1, 0, 3)


def test_the_data_pipelines_batches_carry_host_lengths():
    split = LeaveOneOut(cyclic_dataset(num_users=8, num_items=12))
    train, _ = split.train_batch(np.arange(len(split.train_users)), max_len=5)
    evaluated, _ = split.eval_batch("test", np.arange(4), max_len=50)
    for batch in (train, evaluated):
        assert batch.host_lengths == tuple(batch.lengths.tolist())


def test_a_device_batch_without_host_lengths_has_none_and_given_ones_must_fit_the_shapes():
    host = _batch([2, 3])
    dev = {f.name: getattr(host, f.name) for f in dataclasses.fields(host) if f.name != "host_lengths"}
    dev = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in dev.items()}
    assert JaggedBatch(**dev).host_lengths is None
    assert JaggedBatch(**dev, host_lengths=[3, 2]).host_lengths == (3, 2)  # shapes only: not read
    with pytest.raises(ValueError, match="3 sequences of 5 tokens for a batch of 2 sequences"):
        JaggedBatch(**dev, host_lengths=(1, 2, 2))
    with pytest.raises(ValueError, match="2 sequences of 6 tokens for a batch of 2 sequences of 5 tokens"):
        JaggedBatch(**dev, host_lengths=(3, 3))


def test_contextual_tokens_lengthen_every_sequence():
    batch = _batch([4, 0, 2])
    assert batch.host_lengths_with_context(0) == (4, 0, 2)
    assert batch.host_lengths_with_context(3) == (7, 3, 5)
    batch.host_lengths = None
    assert batch.host_lengths_with_context(3) is None


def test_candidates_are_appended_on_a_device_without_reading_the_offsets():
    host = _batch([4, 1, 3])
    cands = torch.tensor([[7, 8], [9, 10], [11, 12]])
    want, want_hist = append_candidates(host, cands, torch.full((3,), 100))
    assert want.host_lengths == (6, 3, 5) == tuple(want.lengths.tolist())
    got, is_hist = append_candidates(host.to("meta"), cands.to("meta"), torch.full((3,), 100, device="meta"))
    assert got.host_lengths == want.host_lengths
    assert got.item_ids.shape == want.item_ids.shape and is_hist.shape == want_hist.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs an accelerator")
def test_pinning_keeps_the_host_lengths():
    pinned = _batch([2, 5]).pin_memory()
    assert pinned.offsets.is_pinned() and pinned.host_lengths == (2, 5)
    assert pinned.to("cuda", non_blocking=True).host_lengths == (2, 5)

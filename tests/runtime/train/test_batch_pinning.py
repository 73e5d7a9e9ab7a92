"""Prepared batches bound for an accelerator are pinned in the preparing thread; for CPU they are not."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
from grstack_testing import cyclic_dataset

from grstack.runtime.data import JaggedBatch
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.train.batching import (
    BatchStream,
    MicroBatch,
    Preparer,
    Schedule,
    pin_batch,
    pins_batches,
)
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit

HOST_ONLY = {"is_hist"}  # read on the host only (its positions travel as hist_index / cand_index)


def _prep(sharing: str) -> Preparer:
    cfg = Config.model_validate({
        "data": {"max_len": 12}, "model": {"d_model": 8, "num_heads": 2, "dqk": 4, "dv": 4},
        "loss": {"negatives": 5, "ranking_candidates": 3, "sharing": sharing, "group_size": 4},
        "negatives": {"share_k": 2 if sharing != "batch" else 1},
        "train": {"batch_size": 16, "epochs": 1}, "pipeline": {"microbatches": 2}})
    split = LeaveOneOut(cyclic_dataset(num_users=40))
    s = Schedule(split, cfg, world_size=1, ranking_candidates=3)
    return Preparer(s, cfg, rank=0, num_items=split.ds.num_items, num_tasks=1, ranking=True)


def _device_tensors(mb: MicroBatch) -> list[torch.Tensor]:
    """Every tensor of a micro-batch that the step moves to the device."""
    out: list[torch.Tensor] = []
    for f in fields(mb):
        v = getattr(mb, f.name)
        if f.name in HOST_ONLY:
            continue
        if isinstance(v, JaggedBatch):
            out += [getattr(v, g.name) for g in fields(v) if isinstance(getattr(v, g.name), torch.Tensor)]
        elif isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def test_batches_are_pinned_for_accelerators_only():
    assert pins_batches(torch.device("cuda")) and pins_batches(torch.device("cuda", 1))
    assert pins_batches(SimpleNamespace(type="npu"))  # type: ignore[arg-type]  # needs torch_npu to construct
    assert not pins_batches(torch.device("cpu"))


@pytest.mark.parametrize("sharing", ["batch", "token"])
def test_pin_batch_pins_every_tensor_the_step_moves(monkeypatch, sharing):
    """With a stand-in pin (a copy, recorded): every tensor the step copies to the device is replaced by its
    pinned copy, with the same values; the lookup units are left alone."""
    prep = _prep(sharing)
    batch = prep(0, 0, 0)
    pinned: set[int] = set()

    def pin(t: torch.Tensor) -> torch.Tensor:
        copy = t.clone()
        pinned.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    out = pin_batch(batch)
    assert len(out.micro) == len(batch.micro) == 2
    for before, after in zip(batch.micro, out.micro, strict=True):
        moved = _device_tensors(after)
        assert moved and all(id(t) in pinned for t in moved)
        for a, b in zip(_device_tensors(before), moved, strict=True):
            assert torch.equal(a, b)
        assert after.is_hist is before.is_hist
    extra = [out.batch_neg_ids, out.inv_batch_neg]
    assert all(id(t) in pinned for t in extra if t is not None)
    assert (out.batch_neg_ids is not None) == (sharing == "batch")
    assert out.units is batch.units


def test_a_stream_for_cpu_pins_nothing():
    prep = _prep("batch")
    for background in (True, False):
        stream = BatchStream(iter([(0, 0, 0)]), prep, depth=1, background=background, device=torch.device("cpu"))
        got = stream.next()
        assert got is not None and stream.next() is None
        assert not any(t.is_pinned() for mb in got.micro for t in _device_tensors(mb))
        assert torch.equal(got.micro[0].full.item_ids, prep(0, 0, 0).micro[0].full.item_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device")
def test_a_stream_for_cuda_pins_in_its_thread():
    prep = _prep("token")
    for background in (True, False):
        stream = BatchStream(iter([(0, 0, 0)]), prep, depth=1, background=background, device=torch.device("cuda"))
        got = stream.next()
        assert got is not None
        assert all(t.is_pinned() for mb in got.micro for t in _device_tensors(mb))
        assert torch.equal(got.micro[0].full.item_ids, prep(0, 0, 0).micro[0].full.item_ids)

"""The bucketed dense all-reduce: exact sums on two gloo ranks, launches during backward in bucket order,
gradient accumulation, a parameter only one rank reaches, and ``p.grad`` kept a view into its bucket.

The two-rank cases run once (``ranks`` fixture: one ``call_ranks`` of ``reducer_on_ranks`` below, which
the children import from this file) and each test reads its part of the result."""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from grstack_dist_workers import DIST_ENV
from torch import nn

from grstack.runtime.embedding import Comm, CommLog, attach_log
from grstack.runtime.streams import StreamSet
from grstack.runtime.train.dense_reducer import BucketedAllReduce, assign_buckets
from grstack.runtime.train.launch import call_ranks

pytestmark = pytest.mark.integration

SMALL = 256  # bytes per bucket: the test net splits into several buckets
WINDOWS = (1, 3, 2)  # micro-batches per accumulation window


class Net(nn.Module):
    """Mixed shapes and dtypes; ``side`` is reached only when the forward is asked to use it."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.cube = nn.Parameter(0.1 * torch.randn(2, 4, 16, generator=g))
        self.gain = nn.Parameter(torch.ones(16, dtype=torch.float64))
        self.side = nn.Parameter(0.1 * torch.randn(16, generator=g))
        self.out = nn.Linear(16, 3)
        with torch.no_grad():
            for p in (*self.inp.parameters(), *self.out.parameters()):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = h * (1 + self.cube.mean(dim=(0, 1))) * self.gain.to(h.dtype)
        if use_side:
            h = h + self.side * h
        return self.out(h)


def loss_of(net: Net, rank: int, window: int, micro: int, use_side: bool = True) -> torch.Tensor:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * window + 10 * micro + rank))
    return (net(x, use_side) ** 2).mean()


def in_bucket(p: nn.Parameter, reducer: BucketedAllReduce) -> bool:
    """``p.grad`` points into one of the reducer's flat buffers."""
    assert p.grad is not None
    ptr = p.grad.data_ptr()
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in reducer.buffers)


def window(reducer: BucketedAllReduce, losses: list[Callable[[], torch.Tensor]]) -> None:
    """One accumulation window: the backward of every loss but the last unarmed."""
    reducer.start_window()
    for loss in losses[:-1]:
        loss().backward()
    reducer.arm()
    losses[-1]().backward()
    reducer.flush()
    reducer.wait()


def flat_sum(grads: list[torch.Tensor | None], params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The reference: every gradient (zeros where None) in one flat all-reduce per dtype, split back."""
    import torch.distributed as dist

    out: list[torch.Tensor] = [torch.empty(0)] * len(params)
    for dtype in sorted({p.dtype for p in params}, key=str):  # one order on every rank
        idx = [i for i, p in enumerate(params) if p.dtype == dtype]
        flat = torch.cat([(grads[i] if grads[i] is not None else torch.zeros_like(params[i])).reshape(-1)
                          for i in idx])
        dist.all_reduce(flat)
        at = 0
        for i in idx:
            out[i] = flat[at : at + params[i].numel()].view_as(params[i])
            at += params[i].numel()
    return out


def _name_thread() -> None:
    threading.current_thread().name = "grstack-comm"


def exact_case(rank: int, comm: Comm, log: CommLog, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """Three windows of SGD with the reducer (and the CPU lanes) against plain autograd + one flat sum."""
    net, ref = Net(), Net()
    trace: list[tuple[str, str, int | None]] = []
    reducer = BucketedAllReduce(list(net.parameters()), comm, pool.submit, StreamSet.for_device(
        torch.device("cpu"), trace), bucket_bytes=SMALL)
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict[str, Any] = {"buckets": reducer.buckets, "grads_equal": [], "params_equal": [], "views": [],
                           "launched_before_arm": [], "in_backward": [], "all_reduces": []}
    params, ref_params = list(net.parameters()), list(ref.parameters())
    for w, n in enumerate(WINDOWS):
        before = reducer.launched_in_backward
        reducer.start_window()
        events = len(log.events)
        for m in range(n - 1):
            loss_of(net, rank, w, m).backward()
        out["launched_before_arm"].append(len(log.events) - events + reducer.launched_in_backward - before)
        out["views"].append(all(in_bucket(p, reducer) for p in params))
        reducer.arm()
        loss_of(net, rank, w, n - 1).backward()
        out["in_backward"].append(reducer.launched_in_backward - before)
        reducer.flush()
        reducer.wait()
        out["all_reduces"].append(sum(e.op == "all_reduce" for e in log.events[events:]))
        out["views"].append(all(in_bucket(p, reducer) for p in params))
        ref_opt.zero_grad(set_to_none=True)
        for m in range(n):
            loss_of(ref, rank, w, m).backward()
        expected = flat_sum([p.grad for p in ref_params], ref_params)
        out["grads_equal"].append([torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True)])
        for p, e in zip(ref_params, expected, strict=True):
            p.grad = e.clone()
        opt.step()
        ref_opt.step()
        out["params_equal"].append(all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)))
    out["trace"] = trace
    return out


def unreached_case(rank: int, comm: Comm, log: CommLog, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """``side`` is reached on rank 0 only (window 0), then on rank 1 too but in an unarmed backward only
    (window 1). No optimizer step: a fresh ``Net`` has the same parameters and gives the local gradients."""
    net = Net()
    params = list(net.parameters())
    side = next(i for i, p in enumerate(params) if p is net.side)
    reducer = BucketedAllReduce(params, comm, pool.submit, bucket_bytes=SMALL)
    start = len(log.events)
    uses_per_window = [(rank == 0, rank == 0), (True, rank == 0)]
    out: dict[str, Any] = {"windows": []}
    for w, uses in enumerate(uses_per_window):
        ref = Net()
        for m, use in enumerate(uses):
            loss_of(ref, rank, w, m, use).backward()
        before = (reducer.launched_in_backward, reducer.launched_at_flush)
        window(reducer, [partial(loss_of, net, rank, w, m, use) for m, use in enumerate(uses)])
        expected = flat_sum([p.grad for p in ref.parameters()], params)
        out["windows"].append({
            "side_none": net.side.grad is None,
            "side_equal": net.side.grad is not None and torch.equal(net.side.grad, expected[side]),
            "others_equal": all(torch.equal(p.grad, expected[i]) for i, p in enumerate(params) if i != side),
            "in_backward": reducer.launched_in_backward - before[0],
            "at_flush": reducer.launched_at_flush - before[1],
        })
    events = [e for e in log.events[start:] if e.op == "all_reduce"]
    out["order"] = [(e.nbytes, e.dtype) for e in events]
    out["threads"] = sorted({e.thread for e in events})
    out["side_bucket"] = next(b for b, members in enumerate(assign_buckets(params, SMALL)) if side in members)
    out["buckets"] = len(reducer.buckets)
    return out


def tail_case(rank: int, comm: Comm, log: CommLog, pool: ThreadPoolExecutor) -> dict[str, Any]:
    """A reducer with a 3-element tail: the last bucket waits for ``release`` (after flush), then carries the
    rank's values, summed with its gradients in one all-reduce."""
    net, ref = Net(), Net()
    reducer = BucketedAllReduce(list(net.parameters()), comm, pool.submit, bucket_bytes=SMALL, tail=3)
    out: dict[str, Any] = {"buckets": reducer.buckets, "windows": []}
    params = list(net.parameters())
    for w, n in enumerate(WINDOWS):
        start = len(log.events)
        reducer.start_window()
        for m in range(n - 1):
            loss_of(net, rank, w, m).backward()
        reducer.arm()
        loss_of(net, rank, w, n - 1).backward()
        reducer.flush()
        pool.submit(lambda: None).result()  # every launch so far has been issued
        before_release = sum(e.op == "all_reduce" for e in log.events[start:])
        values = torch.tensor([1.0 + rank, 10.0 * w, -rank], dtype=torch.float32)
        reducer.release(values)
        reducer.wait()
        ref.zero_grad(set_to_none=True)
        for m in range(n):
            loss_of(ref, rank, w, m).backward()
        expected = flat_sum([p.grad for p in ref.parameters()], params)
        events = [e for e in log.events[start:] if e.op == "all_reduce"]
        assert reducer.tail is not None
        out["windows"].append({
            "before_release": before_release, "all_reduces": len(events), "last_nbytes": events[-1].nbytes,
            "tail": reducer.tail.tolist(),
            "grads_equal": all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))})
        for p, q in zip(params, ref.parameters(), strict=True):  # the next window starts from equal params
            q.data.copy_(p.data)
    return out


def reducer_on_ranks(env: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """Rank body: a gloo world, one ``world`` Comm with a CommLog, a one-thread ``grstack-comm`` issuer."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}", rank=env.rank,
                            world_size=env.world_size, timeout=datetime.timedelta(seconds=60))
    comm = Comm(None, list(range(env.world_size)), env.rank, "world", live=True)
    log = CommLog()
    attach_log([comm], log)
    pool = ThreadPoolExecutor(1, initializer=_name_thread)
    try:
        return {"exact": exact_case(env.rank, comm, log, pool),
                "unreached": unreached_case(env.rank, comm, log, pool),
                "tail": tail_case(env.rank, comm, log, pool)}
    finally:
        pool.shutdown()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    here = str(Path(__file__).resolve().parent)
    env = {"PYTHONPATH": os.pathsep.join((here, DIST_ENV["PYTHONPATH"]))}
    return call_ranks(f"{Path(__file__).stem}:reducer_on_ranks", 2, {}, env=env, limit_s=120)


def test_buckets_equal_one_flat_all_reduce_bitwise(ranks):
    for r in ranks:
        ex = r["exact"]
        assert len(ex["buckets"]) >= 4
        assert all(all(w) for w in ex["grads_equal"]), ex["grads_equal"]
        assert all(ex["params_equal"])  # the optimizer read the sums through the views


def test_accumulation_launches_only_in_the_armed_backward(ranks):
    for r in ranks:
        ex = r["exact"]
        assert ex["launched_before_arm"] == [0, 0, 0]
        assert ex["all_reduces"] == [len(ex["buckets"])] * len(WINDOWS)  # once per bucket and window


def test_buckets_launch_during_backward(ranks):
    for r in ranks:
        ex = r["exact"]
        # every parameter is reached, so every bucket completes (and launches) inside the armed backward
        assert ex["in_backward"] == [len(ex["buckets"])] * len(WINDOWS)


def test_each_launch_waits_for_a_compute_marker_on_the_comm_lane(ranks):
    trace = ranks[0]["exact"]["trace"]
    records = [m for lane, op, m in trace if (lane, op) == ("compute", "record")]
    waits = [m for lane, op, m in trace if (lane, op) == ("comm", "wait")]
    assert len(records) == len(ranks[0]["exact"]["buckets"]) * len(WINDOWS)
    assert waits == records  # the issuing thread waits each bucket's marker, in launch order
    for m in records:
        i = trace.index(("comm", "wait", m))
        assert trace.index(("compute", "record", m)) < i and trace[i - 1] == ("comm", "enter", None)
        assert trace[i + 1] == ("comm", "keep", None)


def test_grads_stay_views_into_the_buckets_across_windows(ranks):
    for r in ranks:
        assert all(r["exact"]["views"])


def test_a_parameter_one_rank_does_not_reach(ranks):
    r0, r1 = ranks[0]["unreached"], ranks[1]["unreached"]
    assert r0["order"] == r1["order"] and len(r0["order"]) == 2 * r0["buckets"]  # the same issue order
    assert r0["threads"] == r1["threads"] == ["grstack-comm"]
    first, second = r0["windows"][0], r1["windows"][0]
    assert first["side_equal"] and not first["side_none"] and first["others_equal"]
    assert second["side_none"] and second["others_equal"]
    # rank 1's bucket holding `side` never completes in backward: it and every later one launch at flush
    assert second["in_backward"] == r1["side_bucket"] and second["at_flush"] == r1["buckets"] - r1["side_bucket"]
    assert first["in_backward"] == r0["buckets"]
    # window 1: rank 1 reaches `side` in an unarmed backward only: it has a gradient (the sum), launched at flush
    assert not r1["windows"][1]["side_none"] and r1["windows"][1]["side_equal"]
    assert r1["windows"][1]["others_equal"] and r1["windows"][1]["at_flush"] > 0


def test_a_tail_rides_in_the_last_bucket_launched_at_release(ranks):
    for r in ranks:
        t = r["tail"]
        nb = len(t["buckets"])
        for w, got in enumerate(t["windows"]):
            assert got["before_release"] == nb - 1  # hooks and flush hold the last bucket back
            assert got["all_reduces"] == nb  # and the values cost no collective of their own
            assert got["last_nbytes"] == t["buckets"][-1]  # the held bucket, tail included, goes last
            assert got["tail"] == [3.0, 20.0 * w, -1.0]  # summed over the two ranks
            assert got["grads_equal"]
    assert ranks[0]["tail"]["buckets"] == ranks[1]["tail"]["buckets"]


def test_a_tail_without_a_group_keeps_the_values_and_misuse_is_refused():
    net = Net()
    plain = BucketedAllReduce(list(net.parameters()), _single(), _no_submit, bucket_bytes=SMALL)
    tailed = BucketedAllReduce(list(Net().parameters()), _single(), _no_submit, bucket_bytes=SMALL, tail=2)
    assert plain.tail is None and tailed.tail_dtype == torch.float32
    other = BucketedAllReduce(list(Net().parameters()), _single(), _no_submit, bucket_bytes=SMALL, tail=2,
                              tail_dtype=torch.float64)  # values of another dtype than the last bucket's: no tail
    assert other.tail is None and other.buckets == plain.buckets
    assert tailed.buckets[-1] == plain.buckets[-1] + 2 * 4 and tailed.buckets[:-1] == plain.buckets[:-1]
    tailed.start_window()
    with pytest.raises(ValueError, match="3 values for a tail of 2"):
        tailed.release(torch.zeros(3))
    tailed.release(torch.tensor([4.0, 5.0]))
    tailed.wait()
    assert tailed.tail is not None and tailed.tail.tolist() == [4.0, 5.0]
    plain.start_window()
    with pytest.raises(RuntimeError, match="without a tail"):
        plain.release(torch.zeros(1))
    with pytest.raises(ValueError, match="non-negative"):
        BucketedAllReduce(list(Net().parameters()), _single(), _no_submit, tail=-1)


def _no_submit(fn: Any, *args: Any) -> Future:
    raise AssertionError("a group that is not live issues nothing")


def _single() -> Comm:
    return Comm(None, [0], 0, "world", live=False)


def test_without_a_live_group_grads_equal_plain_autograd():
    net, ref = Net(), Net()
    reducer = BucketedAllReduce(list(net.parameters()), _single(), _no_submit, bucket_bytes=SMALL)
    for w, n in enumerate(WINDOWS):
        window(reducer, [partial(loss_of, net, 0, w, m, False) for m in range(n)])
        ref.zero_grad(set_to_none=True)
        for m in range(n):
            loss_of(ref, 0, w, m, use_side=False).backward()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            assert q.grad is None or torch.equal(p.grad, q.grad)
    assert net.side.grad is None  # unreached: AdamW skips it, as with plain autograd
    assert reducer.launched_in_backward == reducer.launched_at_flush == 0


def test_autograd_accumulates_into_the_bucket_in_place():
    net = Net()
    reducer = BucketedAllReduce(list(net.parameters()), _single(), _no_submit, bucket_bytes=SMALL)
    reducer.start_window()
    ptrs = [p.grad.data_ptr() for p in net.parameters()]
    for m in range(2):
        loss_of(net, 0, 0, m).backward()
        assert [p.grad.data_ptr() for p in net.parameters()] == ptrs
        assert all(in_bucket(p, reducer) for p in net.parameters())
    assert all(p.grad.abs().sum() > 0 for p in net.parameters())


def test_bucket_assignment_is_reverse_order_per_dtype_and_capped():
    ps = [nn.Parameter(torch.zeros(n, dtype=d)) for n, d in
          [(10, torch.float32), (4, torch.float64), (100, torch.float32), (3, torch.float32), (2, torch.float64)]]
    buckets = assign_buckets(ps, 64)
    assert buckets == [[4, 1], [3], [2], [0]]  # fp64 together; the 400-byte one alone; 12 + 400 > 64
    assert sorted(i for b in buckets for i in b) == list(range(len(ps)))
    assert all(len({ps[i].dtype for i in b}) == 1 for b in buckets)
    reducer = BucketedAllReduce(ps, _single(), _no_submit, bucket_bytes=64)
    assert reducer.buckets == [48, 12, 400, 40]
    with pytest.raises(ValueError):
        assign_buckets(ps, 0)


def test_misuse_is_refused_not_silently_wrong():
    net = Net()
    reducer = BucketedAllReduce(list(net.parameters()), _single(), _no_submit, bucket_bytes=SMALL)
    with pytest.raises(RuntimeError, match="start_window"):
        loss_of(net, 0, 0, 0).backward()
    reducer.start_window()
    net.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="bucket view"):
        loss_of(net, 0, 0, 0).backward()
    reducer.start_window()
    reducer.arm()
    loss_of(net, 0, 0, 0).backward()
    with pytest.raises(RuntimeError, match="one backward per arm"):
        loss_of(net, 0, 0, 1).backward()
    reducer.start_window()
    reducer.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        loss_of(net, 0, 0, 0).backward()

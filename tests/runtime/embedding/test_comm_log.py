"""The communication log of ``Comm``: off by default; short-circuited collectives (a group that is not live)
are not logged (they move nothing); a live group logs every collective with its bytes on the wire, dtype,
thread, async flag and the caller's step marker. In process: torch.distributed's collectives are replaced by
fakes of a two-member group (the other member sends what this one does). The 4-rank engine run that logs real
collectives is in tests/runtime/bench/test_simulate_ranks.py."""

import threading

import pytest
import torch

from grstack.runtime.embedding import Comm, CommLog, attach_log
from grstack.runtime.embedding import comm as comm_module

pytestmark = pytest.mark.unit


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True


@pytest.fixture
def fake_dist(monkeypatch):
    """Collectives of a two-member group: every member holds this rank's data."""

    def all_to_all_single(out, send, out_split=None, in_split=None, group=None):
        out.copy_(send[: out.shape[0]] if out.shape[0] <= send.shape[0] else
                  torch.cat([send, send])[: out.shape[0]])

    def all_gather(outs, t, group=None):
        for o in outs:
            o.copy_(t)

    def all_reduce(t, op=None, group=None, async_op=False):
        t.mul_(2)
        return _Work() if async_op else None

    def noop(*args, **kwargs):
        return None

    for name, fn in (("all_to_all_single", all_to_all_single), ("all_gather", all_gather),
                     ("all_reduce", all_reduce), ("barrier", noop), ("broadcast_object_list", noop),
                     ("all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))):
        monkeypatch.setattr(comm_module.dist, name, fn)


def _every_collective(c: Comm) -> None:
    rows = torch.ones(5, 4)  # 3 rows to member 0 (this rank), 2 to member 1
    c.all_to_all(rows, [3, 2], [3, 1])
    c.exchange(torch.zeros(2, 3, dtype=torch.int64))
    c.all_gather_v(torch.arange(3, dtype=torch.int64))
    c.all_reduce(torch.ones(7))
    work = c.all_reduce(torch.ones(6), async_op=True)
    if work is not None:
        work.wait()
    c.barrier()
    c.broadcast_object({"a": 1})
    c.all_gather_object(1)


def test_the_log_is_off_by_default_and_costs_nothing(fake_dist):
    c = Comm(None, [0, 1], 0, "g", live=True)
    assert c.log is None
    _every_collective(c)  # runs, nothing to log to
    work = c.all_reduce(torch.ones(2), async_op=True)
    assert isinstance(work, _Work)  # the backend's own handle when not logging


@pytest.mark.parametrize("ranks,live", [([0], None), ([0, 1], False)])
def test_short_circuited_collectives_are_not_logged(ranks, live):
    c = Comm(None, ranks, 0, "solo", live=live)
    log = CommLog()
    attach_log([c], log)
    log.mark(0)
    _every_collective(c)
    c.all_gather_sizes(3)
    assert log.events == [] and c.bytes == 0


def test_a_live_group_logs_every_collective_with_its_wire_bytes(fake_dist):
    twin = Comm(None, [0, 1], 0, "g-meta", live=True)
    c = Comm(None, [0, 1], 0, "g", meta=twin, live=True)
    log = CommLog()
    attach_log([c], log)
    assert c.log is log and twin.log is log
    log.mark(7)
    _every_collective(c)
    log.mark(None)
    ev = log.events
    ops = [(e.op, e.group) for e in ev]
    assert ops == [("all_to_all", "g"), ("exchange", "g"), ("all_gather_sizes", "g-meta"), ("all_gather_v", "g"),
                   ("all_reduce", "g"), ("all_reduce", "g"), ("wait", "g"), ("barrier", "g"),
                   ("broadcast_object", "g"), ("all_gather_object", "g")]
    a2a, exch, sizes, gather, ar, ar_async, wait = ev[:7]
    # All2All: 5 rows of 4 fp32 in, 2 of them leave this rank; 1 row arrives from the other member
    assert (a2a.nbytes, a2a.sent, a2a.recv, a2a.dtype, a2a.split) == (80, 32, 16, "float32", (3, 2))
    assert (exch.nbytes, exch.sent, exch.recv, exch.dtype) == (48, 24, 24, "int64")  # half of [2, 3] int64
    assert (sizes.nbytes, sizes.sent, sizes.split) == (8, 8, ())
    assert (gather.nbytes, gather.sent, gather.recv, gather.split) == (24, 24, 24, (3, 3))
    assert (ar.nbytes, ar.sent, ar.async_op) == (28, 28, False) and ar.seconds >= 0
    assert (ar_async.nbytes, ar_async.async_op, ar_async.seconds) == (24, True, 0.0)
    assert (wait.nbytes, wait.sent, wait.async_op) == (24, 0, False)
    assert all(e.step == 7 and e.group_size == 2 and e.thread == threading.current_thread().name for e in ev)
    assert [e.sent for e in ev[7:]] == [0, 0, 0]
    # the counters Comm always kept are unchanged by logging
    assert c.bytes == 80 + 24 + 28 + 24
    d = log.to_dicts()
    assert d[0]["op"] == "all_to_all" and set(d[0]) >= {"op", "group", "group_size", "nbytes", "sent", "recv",
                                                        "dtype", "seconds", "thread", "async_op", "step"}


def test_events_carry_the_issuing_thread(fake_dist):
    c = Comm(None, [0, 1], 0, "g", live=True)
    log = CommLog()
    attach_log([c], log)
    t = threading.Thread(target=c.all_reduce, args=(torch.ones(3),), name="grstack-prefetch_0")
    t.start()
    t.join()
    attach_log([c], None)
    c.all_reduce(torch.ones(3))  # detached: not logged
    assert [e.thread for e in log.events] == ["grstack-prefetch_0"]

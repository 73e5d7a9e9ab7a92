"""``Comm`` and devices: a group that is not live short-circuits every collective; a live one moves each
out-of-place collective's input to its backend device (``_wire``), refuses an in-place all-reduce of a tensor
elsewhere, and keeps routing metadata on its CPU (gloo) twin. No process group is needed: the refusals
happen before torch.distributed is touched, and the collectives themselves are replaced by recorders."""

import pytest
import torch

from grstack.runtime.embedding import Comm
from grstack.runtime.embedding import comm as comm_module

pytestmark = pytest.mark.unit

META = torch.device("meta")


def _meta_comm(name: str = "x") -> Comm:
    """A live two-rank group whose backend device is ``meta`` (standing in for an accelerator), with its
    CPU metadata twin; no process group behind it."""
    twin = Comm(None, [0, 1], 0, f"{name}-meta", live=True)
    return Comm(None, [0, 1], 0, name, device=META, meta=twin, live=True)


@pytest.fixture
def no_dist(monkeypatch):
    """Every collective fails the test if reached (and nothing is initialised to reach)."""

    def boom(*args, **kwargs):
        raise AssertionError("torch.distributed was called")

    for name in ("all_reduce", "all_to_all_single", "all_gather", "barrier", "broadcast_object_list",
                 "all_gather_object"):
        monkeypatch.setattr(comm_module.dist, name, boom)


@pytest.mark.parametrize("ranks,live", [([0], None), ([0, 1], False)])
def test_a_group_that_is_not_live_short_circuits(no_dist, ranks, live):
    c = Comm(None, ranks, 0, "solo", live=live)
    assert c.live is False and c.device == torch.device("cpu") and c.meta is c
    t = torch.arange(6.0).reshape(3, 2)
    assert c.all_to_all(t, [3], [3]) is t
    assert c.exchange(t) is t
    (g,) = c.all_gather_v(t)
    assert g is t
    assert c.all_gather_sizes(5) == [5]
    before = t.clone()
    assert c.all_reduce(t) is None and c.all_reduce(t, async_op=True) is None
    assert torch.equal(t, before)
    c.barrier()
    box = {"a": 1}
    assert c.broadcast_object(box) is box
    assert c.all_gather_object(box) == [box]
    assert c.seconds == 0.0 and c.bytes == 0
    # a tensor on another device is no problem when nothing is sent
    m = torch.empty(2, 2, device=META)
    assert c.all_to_all(m, [2], [2]) is m and c.all_reduce(m) is None


def test_live_defaults_to_more_than_one_rank():
    assert Comm(None, [0], 0, "a").live is False
    assert Comm(None, [0, 1], 1, "b").live is True
    assert Comm(None, [0], 0, "c", live=True).live is True  # a launched world of one keeps its collectives
    assert Comm(None, [3, 5], 5, "d").index == 1


def test_all_reduce_refuses_a_tensor_on_another_device(no_dist):
    c = _meta_comm("sparse-fwd")
    t = torch.ones(4)
    with pytest.raises(ValueError, match=r"^sparse-fwd: all_reduce of a tensor on cpu; this group's backend "
                                         r"needs meta$"):
        c.all_reduce(t)
    with pytest.raises(ValueError, match=r"sparse-fwd: all_reduce"):
        c.all_reduce(t, async_op=True)
    assert torch.equal(t, torch.ones(4)) and c.bytes == 0
    # and the other way round: a CPU group refuses a device tensor
    cpu = Comm(None, [0, 1], 0, "world", live=True)
    with pytest.raises(ValueError, match=r"^world: all_reduce of a tensor on meta; this group's backend "
                                         r"needs cpu$"):
        cpu.all_reduce(torch.empty(3, device=META))


def test_all_reduce_of_a_tensor_on_the_device_reaches_the_collective(monkeypatch):
    seen = []
    monkeypatch.setattr(comm_module.dist, "all_reduce", lambda t, op=None, group=None: seen.append(t))
    c = _meta_comm()
    t = torch.empty(5, device=META)
    assert c.all_reduce(t) is None
    assert seen == [t] and c.bytes == 4 * 5


def test_a_metadata_group_must_be_on_the_cpu():
    # without a twin, a group on another device would carry its own metadata: refused
    with pytest.raises(ValueError, match=r"^x: the metadata group must be a CPU \(gloo\) group, not meta$"):
        Comm(None, [0, 1], 0, "x", device=META, live=True)
    meta_twin = Comm(None, [0, 1], 0, "x-meta", device=META, meta=Comm(None, [0, 1], 0, "y"), live=True)
    with pytest.raises(ValueError, match=r"^x: the metadata group must be a CPU \(gloo\) group, not meta$"):
        Comm(None, [0, 1], 0, "x", device=META, meta=meta_twin, live=True)
    # a CPU group is its own metadata group; a device group uses its CPU twin
    cpu = Comm(None, [0, 1], 0, "c", live=True)
    assert cpu.meta is cpu
    dev = _meta_comm()
    assert dev.meta is not dev and dev.meta.device == torch.device("cpu")


def test_wire_moves_to_the_backend_device_and_makes_contiguous():
    c = _meta_comm()
    t = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    assert not t.is_contiguous()
    w = c._wire(t)
    assert w.device == META and w.is_contiguous() and w.shape == (4, 3) and w.dtype == t.dtype
    already = torch.empty(2, 3, device=META)
    assert c._wire(already) is already  # nothing to do: the same tensor
    cpu = Comm(None, [0, 1], 0, "c", live=True)
    w = cpu._wire(t)
    assert w.device == torch.device("cpu") and w.is_contiguous() and torch.equal(w, t)
    u = torch.arange(4)
    assert cpu._wire(u) is u


def test_collectives_send_data_on_the_device_and_sizes_on_the_twin(monkeypatch):
    calls = []

    def all_to_all_single(out, send, out_splits=None, in_splits=None, group=None):
        calls.append(("a2a", out.device, send.device, send.is_contiguous(), out_splits, in_splits))

    def all_gather(outs, t, group=None):
        calls.append(("gather", t.device, [o.device for o in outs]))
        for o in outs:
            o.copy_(t)

    monkeypatch.setattr(comm_module.dist, "all_to_all_single", all_to_all_single)
    monkeypatch.setattr(comm_module.dist, "all_gather", all_gather)
    c = _meta_comm()
    send = torch.arange(10.0).reshape(2, 5).t()  # [5, 2], not contiguous, on the host
    out = c.all_to_all(send, [2, 3], [4, 1])
    assert out.device == META and out.shape == (5, 2)
    assert calls == [("a2a", META, META, True, [4, 1], [2, 3])]
    assert c.bytes == send.element_size() * send.numel()
    calls.clear()
    assert c.exchange(torch.zeros(2, 3)).device == META
    assert calls[0][:4] == ("a2a", META, META, True)
    calls.clear()
    # all_gather_v: the row counts go over the CPU twin, the rows over the device
    parts = c.all_gather_v(torch.zeros(3, 4))
    cpu = torch.device("cpu")
    assert calls == [("gather", cpu, [cpu, cpu]), ("gather", META, [META, META])]
    assert [p.shape for p in parts] == [(3, 4), (3, 4)] and all(p.device == META for p in parts)
    # host sizes stay on the host
    calls.clear()
    assert c.meta.all_gather_sizes(7) == [7, 7]
    assert calls == [("gather", torch.device("cpu"), [torch.device("cpu")] * 2)]

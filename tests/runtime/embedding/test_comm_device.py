"""``Comm`` and devices: a group that is not live short-circuits every collective; a live one refuses a
tensor that is not on its backend device (strict placement: it copies nothing between devices), and keeps
routing metadata on its CPU (gloo) twin. No process group is needed: the refusals happen before
torch.distributed is touched, and the collectives themselves are replaced by recorders."""

import pytest
import torch

from grstack.runtime.embedding import CollectiveError, Comm
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
    with pytest.raises(ValueError, match=r"^sparse-fwd: all_reduce of a float32 tensor of shape \(4,\) on cpu; "
                                         r"this group's backend needs meta \(Comm copies nothing"):
        c.all_reduce(t)
    with pytest.raises(ValueError, match=r"sparse-fwd: all_reduce"):
        c.all_reduce(t, async_op=True)
    assert torch.equal(t, torch.ones(4)) and c.bytes == 0
    # and the other way round: a CPU group refuses a device tensor
    cpu = Comm(None, [0, 1], 0, "world", live=True)
    with pytest.raises(ValueError, match=r"^world: all_reduce of a float32 tensor of shape \(3,\) on meta; "
                                         r"this group's backend needs cpu"):
        cpu.all_reduce(torch.empty(3, device=META))


def _every_tensor_collective(c: Comm, t: torch.Tensor) -> dict[str, object]:
    return {"all_to_all": lambda: c.all_to_all(t, [1, 1], [1, 1]), "exchange": lambda: c.exchange(t),
            "all_gather_v": lambda: c.all_gather_v(t), "all_gather": lambda: c.all_gather(t),
            "all_reduce": lambda: c.all_reduce(t)}


def test_a_gloo_group_refuses_a_tensor_on_another_device_before_any_network_call(no_dist):
    """Nothing is copied: every collective names the group, itself, the tensor and the device it needs."""
    gloo = Comm(None, [0, 1], 0, "sparse-pre", live=True)  # a gloo group: its device is the CPU
    t = torch.empty(2, 3, dtype=torch.float16, device=META)
    for op, call in _every_tensor_collective(gloo, t).items():
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == (f"sparse-pre: {op} of a float16 tensor of shape (2, 3) on meta; this group's "
                                   "backend needs cpu (Comm copies nothing: move it there before the collective)")
    assert gloo.bytes == 0 and gloo.seconds == 0.0


def test_a_device_group_refuses_host_tensors_and_its_twin_device_ones(no_dist):
    c = _meta_comm("sparse-fwd")
    host = torch.zeros(2, 4, dtype=torch.int64)
    for op, call in _every_tensor_collective(c, host).items():
        with pytest.raises(ValueError, match=rf"^sparse-fwd: {op} of a int64 tensor of shape \(2, 4\) on cpu; "
                                             r"this group's backend needs meta "):
            call()
    for op, call in _every_tensor_collective(c.meta, torch.zeros(2, 1, device=META)).items():
        with pytest.raises(ValueError, match=rf"^sparse-fwd-meta: {op} of a float32 .* needs cpu "):
            call()


def test_a_device_without_an_index_takes_any_of_its_kind():
    """``cuda`` (a plain single-process run's device) accepts a tensor on ``cuda:0``; ``cuda:1`` does not."""
    twin = Comm(None, [0, 1], 0, "w-meta", live=True)
    plain = Comm(None, [0, 1], 0, "w", device=torch.device("cuda"), meta=twin, live=True)
    indexed = Comm(None, [0, 1], 0, "w", device=torch.device("cuda", 1), meta=twin, live=True)
    t = torch.empty(1, device=META)
    assert t.device.type != "cuda"
    for c in (plain, indexed):
        with pytest.raises(ValueError, match=r"on meta; this group's backend needs cuda"):
            c._placed(t, "all_reduce")
    # the index check itself, on a stand-in with a cuda:0 device (no GPU needed)
    class _OnCuda0:
        device = torch.device("cuda", 0)
        dtype = torch.float32
        shape = (1,)

    plain._placed(_OnCuda0(), "all_reduce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"on cuda:0; this group's backend needs cuda:1"):
        indexed._placed(_OnCuda0(), "all_reduce")  # type: ignore[arg-type]


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


def test_wire_makes_contiguous_on_the_same_device():
    c = _meta_comm()
    already = torch.empty(2, 3, device=META)
    assert c._wire(already, "exchange") is already  # nothing to do: the same tensor
    strided = torch.empty(3, 4, device=META).t()
    w = c._wire(strided, "exchange")
    assert w.device == META and w.is_contiguous() and w.shape == (4, 3)
    cpu = Comm(None, [0, 1], 0, "c", live=True)
    t = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    w = cpu._wire(t, "exchange")
    assert w.device == torch.device("cpu") and w.is_contiguous() and torch.equal(w, t)
    u = torch.arange(4)
    assert cpu._wire(u, "exchange") is u


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
    send = torch.empty(2, 5, device=META).t()  # [5, 2], not contiguous, on the device
    out = c.all_to_all(send, [2, 3], [4, 1])
    assert out.device == META and out.shape == (5, 2)
    assert calls == [("a2a", META, META, True, [4, 1], [2, 3])]
    assert c.bytes == send.element_size() * send.numel()
    calls.clear()
    assert c.exchange(torch.zeros(2, 3, device=META)).device == META
    assert calls[0][:4] == ("a2a", META, META, True)
    calls.clear()
    # all_gather_v: the row counts go over the CPU twin, the rows over the device
    parts = c.all_gather_v(torch.zeros(3, 4, device=META))
    cpu = torch.device("cpu")
    assert calls == [("gather", cpu, [cpu, cpu]), ("gather", META, [META, META])]
    assert [p.shape for p in parts] == [(3, 4), (3, 4)] and all(p.device == META for p in parts)
    # host sizes stay on the host
    calls.clear()
    assert c.meta.all_gather_sizes(7) == [7, 7]
    assert calls == [("gather", torch.device("cpu"), [torch.device("cpu")] * 2)]


def test_a_backend_failure_names_the_group_and_the_collective(monkeypatch):
    cause = RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms for recv operation\nmore")

    def fails(*args, **kwargs):
        raise cause

    monkeypatch.setattr(comm_module.dist, "all_to_all_single", fails)
    monkeypatch.setattr(comm_module.dist, "barrier", fails)
    c = Comm(None, [0, 1], 0, "sparse-fwd", live=True)
    with pytest.raises(CollectiveError) as info:
        c.exchange(torch.zeros(2, 1))
    err = info.value
    assert (err.group, err.op, err.cause) == ("sparse-fwd", "exchange", cause) and err.__cause__ is cause
    assert str(err) == ("exchange on group sparse-fwd failed: [gloo/transport/tcp/pair.cc:534] Timed out waiting "
                        "20000ms for recv operation")
    with pytest.raises(CollectiveError, match=r"^barrier on group sparse-fwd failed: "):
        c.barrier()
    # an argument the caller got wrong is not a backend failure
    monkeypatch.setattr(comm_module.dist, "all_to_all_single", lambda *a, **k: (_ for _ in ()).throw(TypeError("x")))
    with pytest.raises(TypeError):
        c.exchange(torch.zeros(2, 1))

"""``bench simulate``'s model on a hand-made log: the network formulas' values, the byte scaling of each
logged event, the replay of the engine's overlap (FIFO communication thread, prefetch beside the step,
async all-reduce until its wait), the union model, and the efficiency relative to the smallest W."""

import math

import pytest

from grstack.runtime.bench.simulate import (
    Assumptions,
    Logged,
    NetworkModel,
    Target,
    UnionModel,
    comm_tasks,
    event_seconds,
    replay_step,
    scale_bytes,
    scaling,
    union_events_at,
)
from grstack.runtime.embedding import union_by_mask

pytestmark = pytest.mark.unit

NET = NetworkModel(devices_per_node=4, intra_gbps=100.0, inter_gbps=10.0, intra_latency_us=2.0,
                   inter_latency_us=10.0, host_gbps=1.0, host_latency_us=50.0)


def ev(op, group, nbytes, dtype="float32", thread="MainThread", async_op=False, step=1, start=0.0):
    return {"op": op, "group": group, "group_size": 2, "nbytes": nbytes, "sent": nbytes, "recv": nbytes,
            "dtype": dtype, "seconds": 0.0, "thread": thread, "async_op": async_op, "step": step, "start": start}


def test_network_formulas():
    B = 8e6
    # All2All in one node of 4: 3 peers x (2 us + B/4 / 100 GB/s)
    assert NET.all_to_all(4, 4, B) == pytest.approx(3 * (2e-6 + 2e6 / 100e9))
    # over 2 nodes (8 members, 4 a node): the inter-node part dominates: 4 x (10 us + 1 MB / 10 GB/s)
    assert NET.all_to_all(8, 4, B) == pytest.approx(4 * (10e-6 + 1e6 / 10e9))
    # flat all-reduce inside a node: min(ring, tree)
    ring = 2 * 3 * 2e-6 + 2 * 3 / 4 * B / 100e9
    tree = 2 * 2 * 2e-6 + 2 * B / 100e9
    assert NET.all_reduce(4, 4, B) == pytest.approx(min(ring, tree))
    # one member per node: inter-node flat
    assert NET.all_reduce(16, 1, B) == pytest.approx(min(2 * 15 * 10e-6 + 2 * 15 / 16 * B / 10e9,
                                                         2 * 4 * 10e-6 + 2 * B / 10e9))
    # hierarchical: 16 members, 4 a node -> intra RS + AG, inter all-reduce of B/4 over 4 nodes
    inter = min(2 * 3 * 10e-6 + 2 * 3 / 4 * (B / 4) / 10e9, 2 * 2 * 10e-6 + 2 * (B / 4) / 10e9)
    assert NET.all_reduce(16, 4, B) == pytest.approx(2 * 3 * (2e-6 + B / 4 / 100e9) + inter)
    # ring all-gather across nodes: (N-1)(a + piece/b)
    assert NET.all_gather(8, 4, 1000) == pytest.approx(7 * (10e-6 + 1000 / 10e9))
    assert NET.all_gather(4, 4, 1000) == pytest.approx(3 * (2e-6 + 1000 / 100e9))
    assert NET.all_to_all(1, 4, B) == NET.all_reduce(1, 1, B) == 0.0


def test_host_metadata_uses_the_host_link():
    t = Target(workers=16, sparse_group=4, d_model=8, dense_params=10)
    e = ev("all_gather_v", "replica", 800, dtype="int64")
    # replica group of 16/4 = 4 members, one a node: ring on the host link
    assert event_seconds(e, 800.0, t, NET) == pytest.approx(3 * (50e-6 + 800 / 1e9))


def test_byte_scaling_of_each_event_kind():
    lg = Logged(ranks=4, sparse_group=2, d_model=64)
    t = Target(workers=64, sparse_group=8, d_model=256, dense_params=1000)

    def union(n):
        return 100.0 * n ** 0.5

    assert scale_bytes(ev("exchange", "sparse-pre", 160, "int64"), t, lg, union) == 160 * 8 / 2
    assert scale_bytes(ev("all_to_all", "sparse-pre", 800, "int64"), t, lg, union) == 800
    assert scale_bytes(ev("all_to_all", "sparse-fwd", 1000), t, lg, union) == 1000 * 256 / 64
    assert scale_bytes(ev("all_reduce", "sparse-fwd", 4), t, lg, union) == 4
    assert scale_bytes(ev("all_gather_sizes", "replica", 8, "int64"), t, lg, union) == 8
    assert scale_bytes(ev("all_gather_v", "replica", 400, "int64"), t, lg, union) == pytest.approx(
        400 * (union(8) / 8) / (union(2) / 2))
    assert scale_bytes(ev("all_reduce", "replica", 2560), t, lg, union) == pytest.approx(
        2560 * (union(64) / 8) / (union(4) / 2) * 4)
    assert scale_bytes(ev("all_reduce", "replica", 2560), t, lg, union, union_scale=2.0) == pytest.approx(
        2 * 2560 * (union(64) / 8) / (union(4) / 2) * 4)
    # a dense bucket: the target's dense gradient; the stats (4 + W floats) travel in their own all-reduce
    assert scale_bytes(ev("all_reduce", "world", 999, async_op=True), t, lg, union) == 4 * 1000
    assert scale_bytes(ev("all_reduce", "world", 32, async_op=True), t, lg, union) == 4 * (4 + 64)
    assert scale_bytes(ev("all_reduce", "world", 999), t, lg, union) == 4 * (4 + 64)


def test_comm_task_order_is_the_engines():
    stats = {"mb_units": [1, 2, 3], "neg_unit": 0}
    assert comm_tasks(stats) == [("rows", 0), ("rows", 1), ("rows", 2), ("grads", 1), ("rows", 3), ("grads", 2),
                                 ("grads", 3), ("grads", 0)]
    assert comm_tasks({"mb_units": [0], "neg_unit": None}) == [("rows", 0), ("grads", 0)]


def test_replay_overlaps_what_the_engine_overlaps():
    # 2 micro-batches, no shared negatives: comm tasks rows0, rows1, grads0, grads1 (1 event each)
    stats = {"mb_units": [0, 1], "neg_unit": None, "unit_events": [1, 1], "mb_flops": [10.0, 10.0]}
    comm = [ev("all_to_all", "sparse-fwd", n, thread="grstack-comm_0") for n in (1, 2, 3, 4)]
    main = [ev("all_reduce", "world", 5, async_op=True), ev("all_reduce", "replica", 6),
            ev("wait", "world", 0)]
    pre = [ev("exchange", "sparse-pre", 7, "int64", thread="grstack-prefetch_0"),
           ev("all_to_all", "sparse-pre", 8, "int64", thread="grstack-prefetch_0")]
    dur = {1: 2.0, 2: 3.0, 3: 1.0, 4: 1.0, 5: 9.0, 6: 4.0, 7: 1.0, 8: 1.0}
    out = replay_step(main, comm, pre, stats, lambda e: dur[e["nbytes"]], flops_per_s=1.0)
    # main: waits rows0 until 2; submits rows1 (runs 2..5); computes 2..12; grads0 runs 12..13; rows1 was
    # ready at 5; compute 12..22; grads1 22..23; waits grads0 (done) and grads1 until 23 -> blocked 0..2, 22..23
    # then: async all-reduce 23..32, replica all-reduce 23..27, wait until 32
    assert out["compute_s"] == 20.0
    assert out["step_s"] == pytest.approx(32.0)
    assert out["exposed_comm_s"] == pytest.approx(12.0)
    by = {e["logged_bytes"]: e for e in out["events"]}
    assert by[1]["exposed_ms"] == pytest.approx(2e3) and by[2]["exposed_ms"] == 0.0
    assert by[3]["exposed_ms"] == 0.0 and by[4]["exposed_ms"] == pytest.approx(1e3)
    assert by[6]["exposed_ms"] == pytest.approx(4e3) and by[5]["exposed_ms"] == pytest.approx(5e3)
    assert by[7]["exposed_ms"] == by[8]["exposed_ms"] == 0.0  # the prefetch (2 s) hides in the 32 s step
    # a prefetch longer than the step shows: the next step waits for the rest
    dur[7] = 40.0
    out = replay_step(main, comm, pre, stats, lambda e: dur[e["nbytes"]], flops_per_s=1.0)
    assert out["step_s"] == pytest.approx(41.0)
    assert {e["logged_bytes"]: e["exposed_ms"] for e in out["events"]}[8] == pytest.approx(1e3)


def test_a_wrong_task_count_is_an_error():
    stats = {"mb_units": [0], "neg_unit": None, "unit_events": [1], "mb_flops": [1.0]}
    with pytest.raises(ValueError, match="predicts 2"):
        replay_step([], [ev("all_to_all", "sparse-fwd", 1, thread="grstack-comm_0")], [], stats,
                    lambda e: 0.0, 1.0)


def test_union_model_fits_one_batch_and_saturates():
    counts = [100] * 10 + [1] * 90  # 10 popular items of 100
    u = UnionModel(counts, keys_per_batch=20.0, negatives=0.0)
    assert u(1) == pytest.approx(20.0, rel=1e-6)
    assert u(2) > u(1) and u(1000) == pytest.approx(100.0, rel=1e-3)
    nested = UnionModel.measured([[1, 2], [2, 3], [3, 4]], orders=4)
    assert nested[0] == 2.0 and 3.0 <= nested[1] <= 4.0 and nested[2] == 4.0


def test_efficiency_relative_to_the_smallest_w():
    stats = {"mb_units": [0], "neg_unit": None, "unit_events": [1], "mb_flops": [1e12], "keys": [1, 2]}
    events = [ev("all_to_all", "sparse-fwd", 1000, thread="grstack-comm_0", start=0.0),
              ev("all_to_all", "sparse-fwd", 1000, thread="grstack-comm_0", start=0.1),
              ev("all_reduce", "world", 100, async_op=True, start=0.2), ev("wait", "world", 0, start=0.3)]
    ranks = [{"events": events, "stats": [stats, stats, stats]}]
    a = Assumptions(NET, peak_tflops=1.0, mfu=1.0)  # 1 s of compute
    rows = scaling(ranks, [1], [8, 64], 4, 64, 10**6, Logged(1, 1, 64), lambda n: 2.0, a)
    assert rows[0]["scaling_efficiency"] == 1.0
    step = {W: 1.0 + 2 * NET.all_to_all(4, 4, 1000) + NET.all_reduce(W, 4, 4 * (10**6 + 4 + W)) for W in (8, 64)}
    assert rows[0]["step_s"] == pytest.approx(step[8]) and rows[1]["step_s"] == pytest.approx(step[64])
    assert rows[1]["scaling_efficiency"] == pytest.approx(step[8] / step[64])
    assert math.isclose(rows[1]["compute_s"], 1.0)


def test_the_replica_union_is_replayed_the_way_the_engine_would_agree_it_at_the_target():
    lg = Logged(ranks=4, sparse_group=2, d_model=64, table_rows=40_001)

    def union(n):
        return min(40_000.0, 3000.0 * n)

    main = [ev("all_reduce", "world", 999, async_op=True), ev("all_reduce", "replica", 8, "int64"),
            ev("all_gather", "replica", 8 * 1000, "int64"), ev("all_reduce", "replica", 2560),
            ev("wait", "world", 0)]
    # 192 replicas of a 5,000-row shard: everyone's keys (8 B each) would outweigh a 1-byte-per-row mask
    big = union_events_at(main, Target(workers=1536, sparse_group=8, d_model=64, dense_params=10), lg, union)
    ops = [(e["op"], e["dtype"]) for e in big]
    assert ops == [("all_reduce", "float32"), ("all_reduce", "int64"), ("all_reduce", "uint8"),
                   ("all_reduce", "float32"), ("wait", "float32")]
    assert big[2]["target_bytes"] == 5001 and scale_bytes(big[2], Target(1536, 8, 64, 10), lg, union) == 5001
    # 2 replicas of a shard of 20,001 rows touching 1,000 keys each: the keys are fewer bytes
    small = union_events_at(main, Target(workers=4, sparse_group=2, d_model=64, dense_params=10), lg, union)
    assert [(e["op"], e["dtype"]) for e in small][2] == ("all_gather", "int64")
    assert small[2]["target_bytes"] == pytest.approx(8 * 1000)
    # what the engine itself would decide on those numbers
    assert union_by_mask(192, 1000, 5001) and not union_by_mask(2, 1000, 20_001)

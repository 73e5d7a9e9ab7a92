"""The collective-order audit on hand-made CommLog events: what it counts as a violation and as an issuing
thread (the definitions are in ``runtime/train/collective_audit.py``)."""

from typing import Any

import pytest

from grstack.runtime.train.collective_audit import audit_collectives, communicator_name

pytestmark = pytest.mark.unit


def ev(group: str, op: str, start: float, thread: str = "grstack-comm", dtype: str = "float32",
       size: int = 2, async_op: bool = False) -> dict[str, Any]:
    return {"op": op, "group": group, "group_size": size, "thread": thread, "start": start, "dtype": dtype,
            "async_op": async_op, "step": 0}


def program() -> list[dict[str, Any]]:
    """One step: rows on sparse-fwd, the async dense all-reduce on world, its wait, gradients on sparse-fwd."""
    return [ev("sparse-fwd", "all_to_all", 1.0), ev("world", "all_reduce", 2.0, async_op=True),
            ev("world", "wait", 3.0), ev("sparse-fwd", "all_to_all", 4.0)]


def test_identical_sequences_have_no_violation_and_one_thread():
    out = audit_collectives([program(), program()])
    assert out["order_violations"] == 0
    assert out["issuing_threads_per_communicator_max"] == 1
    assert out["device_order"] == {"violations": 0, "first_mismatch": None, "threads_per_rank_max": 1}
    world = out["communicators"]["world/2"]
    # the async all-reduce is issued at its launch; its wait is no issue
    assert world["issues"] == {0: 1, 1: 1} and world["device"] is True and world["violations"] == 0


def test_order_follows_start_not_log_position():
    # a thread that logs later but started earlier: issue order is by start
    shuffled = list(reversed(program()))
    assert audit_collectives([program(), shuffled])["order_violations"] == 0


def test_swapped_cross_group_order_on_rank_1_is_a_violation():
    swapped = [ev("world", "all_reduce", 1.0, async_op=True), ev("sparse-fwd", "all_to_all", 2.0),
               ev("world", "wait", 3.0), ev("sparse-fwd", "all_to_all", 4.0)]
    out = audit_collectives([program(), swapped])
    # each communicator's own order agrees; their merged order does not (positions 0 and 1)
    assert all(c["violations"] == 0 for c in out["communicators"].values())
    assert out["device_order"]["violations"] == 2 and out["order_violations"] == 2
    first = out["device_order"]["first_mismatch"]
    assert first == {"rank": 1, "reference_rank": 0, "index": 0, "reference": ["sparse-fwd/2", "all_to_all"],
                     "issued": ["world/2", "all_reduce"]}


def test_a_missing_collective_counts_as_the_length_difference():
    short = program()[:-1]
    out = audit_collectives([program(), short])
    assert out["communicators"]["sparse-fwd/2"]["violations"] == 1
    assert out["device_order"]["violations"] == 1 and out["order_violations"] == 2
    assert out["device_order"]["first_mismatch"]["issued"] is None


def test_two_threads_on_one_group():
    events = [ev("sparse-fwd", "all_to_all", 1.0, thread="grstack-comm"),
              ev("sparse-fwd", "all_to_all", 2.0, thread="grstack-prefetch")]
    out = audit_collectives([events, events])
    assert out["issuing_threads_per_communicator_max"] == 2
    assert out["communicators"]["sparse-fwd/2"]["threads"] == ["grstack-comm", "grstack-prefetch"]


def test_threads_are_counted_per_communicator_not_per_rank():
    events = [ev("world", "all_reduce", 1.0, thread="MainThread"), ev("sparse-fwd", "all_to_all", 2.0)]
    out = audit_collectives([events, events])
    assert out["issuing_threads_per_communicator_max"] == 1 and out["device_order"]["threads_per_rank_max"] == 2


def test_host_communicators_are_checked_on_their_own_not_in_the_device_order():
    a = [ev("sparse-pre-meta", "exchange", 1.0, dtype="int64"), ev("sparse-fwd", "all_to_all", 2.0)]
    b = [ev("sparse-fwd", "all_to_all", 1.0), ev("sparse-pre-meta", "exchange", 2.0, dtype="int64")]
    out = audit_collectives([a, b])
    assert out["device_order"]["violations"] == 0 and out["order_violations"] == 0
    assert out["communicators"]["sparse-pre-meta/2"]["device"] is False
    # the host communicator's own order is still compared
    c = [ev("sparse-pre-meta", "all_to_all", 1.0, dtype="int64"), ev("sparse-fwd", "all_to_all", 2.0)]
    assert audit_collectives([a, c])["communicators"]["sparse-pre-meta/2"]["violations"] == 1


def test_gloo_logs_put_host_data_on_the_meta_twin():
    # on gloo a Comm is its own meta twin: integer payloads and barriers count where NCCL would run them
    assert communicator_name(ev("sparse-fwd", "exchange", 0.0, dtype="int64"), meta_inline=True) == "sparse-fwd-meta"
    assert communicator_name(ev("sparse-fwd", "exchange", 0.0, dtype="int64")) == "sparse-fwd"
    assert communicator_name(ev("world", "barrier", 0.0, dtype="")) == "world-meta"
    assert communicator_name(ev("sparse-fwd", "all_to_all", 0.0), meta_inline=True) == "sparse-fwd"
    a = [ev("sparse-fwd", "exchange", 1.0, dtype="int64"), ev("world", "all_reduce", 2.0)]
    b = [ev("world", "all_reduce", 1.0), ev("sparse-fwd", "exchange", 2.0, dtype="int64")]
    assert audit_collectives([a, b], meta_inline=True)["order_violations"] == 0
    assert audit_collectives([a, b])["order_violations"] > 0


def test_sparse_pre_carrying_rows_is_a_device_communicator():
    # routing only: host; rows on it (today's semi-async) need an NCCL group there
    routing = [ev("sparse-pre", "all_to_all", 1.0, dtype="int64", thread="grstack-prefetch")]
    assert audit_collectives([routing, routing], meta_inline=True)["communicators"]["sparse-pre-meta/2"]["device"] is False
    rows = [ev("sparse-pre", "all_to_all", 1.0, thread="grstack-prefetch"), ev("sparse-fwd", "all_to_all", 2.0)]
    late = [ev("sparse-fwd", "all_to_all", 1.0), ev("sparse-pre", "all_to_all", 2.0, thread="grstack-prefetch")]
    out = audit_collectives([rows, late], meta_inline=True)
    assert out["communicators"]["sparse-pre/2"]["device"] is True and out["device_order"]["violations"] == 2


def test_members_tell_groups_of_one_name_apart():
    # 4 ranks, sparse groups {0,1} and {2,3}: rank 2 is compared with rank 0 on world only
    fwd01, fwd23 = {"sparse-fwd": [0, 1], "world": [0, 1, 2, 3]}, {"sparse-fwd": [2, 3], "world": [0, 1, 2, 3]}
    r0 = [ev("sparse-fwd", "all_to_all", 1.0), ev("world", "all_reduce", 2.0, size=4)]
    r2 = [ev("sparse-fwd", "exchange", 1.0), ev("world", "all_reduce", 2.0, size=4)]
    out = audit_collectives([r0, r0, r2, r2], members=[fwd01, fwd01, fwd23, fwd23])
    assert out["order_violations"] == 0
    assert set(out["communicators"]) == {"sparse-fwd[0, 1]", "sparse-fwd[2, 3]", "world[0, 1, 2, 3]"}
    # without members both sparse groups look like one, and their different ops like a violation
    assert audit_collectives([r0, r0, r2, r2])["order_violations"] > 0


def test_nothing_logged():
    assert audit_collectives([[], []])["order_violations"] == 0
    assert audit_collectives([[], []])["issuing_threads_per_communicator_max"] == 0

"""The one line a rank prints when it loses a peer: what failed (the collective and its group when one did),
the timeout, and the likely cause; a failed collective counts as a lost peer only when its cause does."""

import pytest
import torch.distributed as dist

from grstack.runtime.embedding import CollectiveError
from grstack.runtime.train.launch import is_peer_failure, peer_failure_message

pytestmark = pytest.mark.unit


def test_a_timed_out_collective_is_named_with_its_group_and_the_timeout():
    cause = dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                                  "OpType=ALLTOALL_BASE, Timeout(ms)=120000)\nran for 120001 milliseconds")
    exc = CollectiveError("sparse-fwd", "all_to_all", cause)
    assert is_peer_failure(exc)
    line = peer_failure_message(3, exc, 120.0)
    assert line == ("rank 3: lost contact with a peer (all_to_all on group sparse-fwd: Watchdog caught collective "
                    "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLTOALL_BASE, Timeout(ms)=120000)); a peer "
                    "likely died or stalled (a collective that does not complete within distributed.timeout_s=120 "
                    "fails); every rank exits so the job can be restarted from its last checkpoint")
    assert "\n" not in line


def test_a_failure_outside_a_collective_and_without_a_timeout_still_reads_as_one_line():
    line = peer_failure_message(0, RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    assert line.startswith("rank 0: lost contact with a peer (Connection closed by peer [127.0.0.1]:29500); a peer "
                           "likely died or stalled (a collective that does not complete fails)")


def test_a_collective_that_failed_for_another_reason_is_not_a_lost_peer():
    bad = CollectiveError("world", "all_reduce", RuntimeError("Tensors must be contiguous"))
    assert not is_peer_failure(bad)
    assert is_peer_failure(CollectiveError("world", "all_reduce", RuntimeError("[gloo] Timed out waiting 5000ms")))

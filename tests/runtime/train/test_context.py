"""The rank's process groups: the failure settings a rank's environment gets before its groups exist, and on
gloo (2 and 4 real ranks) which Comm each thread uses and the warm-up of the device groups at start-up."""

import pytest
from grstack_dist_workers import DIST_ENV

from grstack.runtime.train.context import NCCL_FAILURE_ENV, failure_env
from grstack.runtime.train.launch import call_ranks

pytestmark = pytest.mark.integration


def test_nccl_ranks_get_the_failure_settings_unless_the_user_set_them():
    assert failure_env("nccl", {}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                                       "TORCH_NCCL_ENABLE_MONITORING": "0"} == NCCL_FAILURE_ENV
    mine = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    assert failure_env("nccl", mine) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    # the older name torch still reads counts as the user's choice too
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in failure_env("nccl", {"NCCL_ASYNC_ERROR_HANDLING": "1"})
    # gloo raises on a timeout by itself; HCCL's default reports it and the Watchdog ends the hang
    assert failure_env("gloo", {}) == {} and failure_env("hccl", {}) == {}


def test_two_gloo_ranks_warm_every_device_group_and_keep_every_comm_in_the_log_list():
    ranks = call_ranks("grstack_context_workers:describe_groups", 2, {"group": 0}, env=DIST_ENV, limit_s=240)
    for r, got in enumerate(ranks):
        comms = {c["name"]: c for c in got["comms"]}
        assert list(comms) == ["world", "sparse-fwd", "sparse-pre", "replica"]
        assert got["device_comms"] == ["world", "sparse-fwd", "replica"]
        assert all(c["device"] == "cpu" and c["meta"] == c["name"] for c in comms.values())  # gloo: own twins
        assert comms["world"]["ranks"] == comms["sparse-fwd"]["ranks"] == comms["sparse-pre"]["ranks"] == [0, 1]
        # sparse groups of 2 over 2 ranks: each replica group is one rank, with no process group
        assert comms["replica"]["ranks"] == [r] and not comms["replica"]["live"]
        # the live device groups ran their warm-up collective at start-up; the prefetch group did not
        assert comms["world"]["seconds"] > 0 and comms["sparse-fwd"]["seconds"] > 0
        assert comms["sparse-pre"]["seconds"] == 0 and comms["replica"]["seconds"] == 0


def test_four_gloo_ranks_in_two_sparse_groups_warm_in_one_order_without_waiting_on_each_other():
    ranks = call_ranks("grstack_context_workers:describe_groups", 4, {"group": 2}, env=DIST_ENV, limit_s=300)
    for r, got in enumerate(ranks):
        comms = {c["name"]: c for c in got["comms"]}
        base = 2 * (r // 2)
        assert comms["sparse-fwd"]["ranks"] == comms["sparse-pre"]["ranks"] == [base, base + 1]
        assert comms["replica"]["ranks"] == [r % 2, r % 2 + 2]
        assert all(comms[n]["live"] and comms[n]["seconds"] > 0 for n in ("world", "sparse-fwd", "replica"))

"""Sharded evaluation ranks every target exactly as one matmul over the whole table does (eval_ranks), with
no rank holding more than its shard: world 1 in process, world 2 (one sparse group of 2, and replicas)."""

import numpy as np
import pytest
import torch
from grstack_dist_workers import DIST_ENV, sharded_vs_full_ranks

from grstack.runtime.train.context import DistContext
from grstack.runtime.train.launch import call_ranks

# ML-100K's size: 943 users, 1682 items
PAYLOAD = {"num_users": 943, "num_items": 1682, "max_len": 200, "batch_size": 128,
           "model": {"type": "hstu", "d_model": 32, "num_blocks": 1, "num_heads": 2, "dqk": 16, "dv": 16,
                     "dropout": 0.0, "input_dropout": 0.0}}


def _check(got, rows_expected=None):
    for which in ("valid", "test"):
        sharded, full = got[which]["sharded"], got[which]["full"]
        assert sharded.dtype == np.int64 and sharded.shape == full.shape
        np.testing.assert_array_equal(sharded, full)
    assert got["rows_held_max"] == got["shard_rows"]
    if rows_expected is not None:
        assert got["shard_rows"] == rows_expected


@pytest.mark.unit
def test_world_of_one_matches_eval_ranks():
    torch.set_num_threads(1)
    got = sharded_vs_full_ranks(DistContext.single(torch.device("cpu")), {**PAYLOAD, "batch_size": 100})
    _check(got, 1683)
    assert len(got["test"]["full"]) == 943 and (got["test"]["full"] < 50).any()


@pytest.mark.integration
def test_two_ranks_match_eval_ranks_in_groups_of_two_and_of_one():
    got = call_ranks("grstack_dist_workers:sharded_eval_on_ranks", 2,
                     {**PAYLOAD, "batch_size": 52, "group_sizes": [2, 1]},
                     env=DIST_ENV, limit_s=600)
    for rank in (0, 1):
        _check(got[rank][2], 842 if rank == 0 else 841)  # half the table each
        _check(got[rank][1], 1683)  # groups of one: each rank holds the whole table (a replica)
    assert len(got[0][2]["test"]["full"]) > 2 * len(got[1][2]["test"]["full"])  # uneven round counts

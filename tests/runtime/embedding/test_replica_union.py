"""Replicas of a shard agree on the union of their touched rows by gathered keys or by a presence mask,
whichever moves fewer bytes; both give the same union and the same summed rows, bit for bit, on every
replica, including replicas that touched nothing."""

import pytest
import torch
from grstack_dist_workers import DIST_ENV

from grstack.runtime.embedding import union_by_mask
from grstack.runtime.train.launch import call_ranks

pytestmark = pytest.mark.integration

ROWS, DIM = 50, 4
CASES = {"overlapping": [[1, 4, 9, 30], [4, 5, 30, 49], [0, 9]],
         "one_replica_idle": [[2, 3], [], [3, 7]],
         "all_idle": [[], [], []]}


def test_keys_and_mask_give_the_same_sum_on_every_replica():
    results = call_ranks("grstack_dist_workers:replica_union_both_ways", 3,
                         {"rows": ROWS * 3, "dim": DIM, "cases": CASES}, env=DIST_ENV, limit_s=120)
    for name, per_rank in CASES.items():
        union = sorted(set().union(*per_rank))
        want = torch.zeros(ROWS * 3, DIM)
        for res in results:
            r = res[name]
            want.index_add_(0, r["keys"], r["grad"])
        for res in results:
            r = res[name]
            for way in ("by_keys", "by_mask", "auto"):
                keys, total = r[way]
                if not union:  # nobody touched the shard: nothing to reduce
                    assert total.numel() == 0
                    continue
                assert keys.tolist() == union, (name, way)
                torch.testing.assert_close(total, want[keys])
                assert torch.equal(total, results[0][name][way][1])  # every replica gets the same bits
                assert torch.equal(total, r["by_keys"][1])  # whichever way the union was agreed


def test_the_mask_is_chosen_when_the_replicas_keys_outweigh_it():
    assert union_by_mask(replicas=192, max_keys=5000, shard_rows=5000)
    assert not union_by_mask(replicas=2, max_keys=100, shard_rows=1_000_000)
    assert union_by_mask(replicas=2, max_keys=100, shard_rows=1600) and not union_by_mask(2, 100, 1601)

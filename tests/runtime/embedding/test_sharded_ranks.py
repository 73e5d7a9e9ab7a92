"""The sharded table on real gloo ranks equals one dense table doing the same arithmetic: lookups (FP32
exact, FP16 negatives close), summed gradients, sparse updates; replicas across sparse groups stay identical."""

import pytest
import torch
from grstack_dist_workers import DIST_ENV, rank_grads, rank_ids

from grstack.runtime.embedding.optim import make_sparse_optimizer
from grstack.runtime.embedding.sharded import make_unit
from grstack.runtime.train.launch import call_ranks

pytestmark = pytest.mark.integration

ROWS, DIM = 97, 8


def _reference(world: int, optimizer: str) -> list[torch.Tensor]:
    """The dense table after each of the two steps."""
    full = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    opt = make_sparse_optimizer(optimizer, full, 0.1)
    tables = []
    for step in range(2):
        grad = torch.zeros(ROWS, DIM)
        for r in range(world):
            ids_a = rank_ids(r, step, ROWS, 40)
            negs = rank_ids(r + 100, step, ROWS, 25)
            units = [make_unit(ids_a)[0], make_unit(ids_a[:5], negs)[0]]
            for u, unit in enumerate(units):
                grad.index_add_(0, unit.keys, rank_grads(r, step, u, (unit.num_keys, DIM)))
        touched = torch.nonzero(grad.abs().sum(1) > 0).squeeze(1)
        opt.step(touched, grad[touched])
        tables.append(full.clone())
    return tables


@pytest.mark.parametrize(("world", "group", "optimizer"), [(2, 0, "adagrad"), (4, 2, "adam")])
def test_sharded_table_matches_a_dense_table(world, group, optimizer):
    results = call_ranks("grstack_dist_workers:sharded_lookup_and_update", world,
                         {"rows": ROWS, "dim": DIM, "group": group, "optimizer": optimizer}, env=DIST_ENV,
                         limit_s=180)
    full0 = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    ref = _reference(world, optimizer)
    for res in results:
        first, second = res["looked_up"]
        assert torch.equal(first["rows"], full0[first["ids"]])  # FP32 rows arrive bit for bit
        assert torch.equal(first["head_rows"], full0[first["ids"][:5]])
        torch.testing.assert_close(first["neg_rows"], full0[first["negs"]], atol=2e-3, rtol=1e-3)  # FP16 path
        assert not torch.equal(first["neg_rows"], full0[first["negs"]])
        torch.testing.assert_close(second["rows"], ref[0][second["ids"]], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(res["table"], ref[1], atol=1e-6, rtol=1e-5)
    if group:
        # shard s lives on ranks s, s+G, ...: the replicas received the same summed gradient
        for r in range(group, world):
            assert torch.equal(results[r]["shard"], results[r % group]["shard"])

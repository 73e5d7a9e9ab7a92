"""The item table's initial rows: each a pure function of (seed, row id), N(0, 0.02²), so every rank
materialises only its own rows and a job's initial table does not depend on the number of ranks."""

from pathlib import Path

import pytest
import torch
from grstack_testing import tiny_config_args, write_cyclic

from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.embedding import ShardingPlan
from grstack.runtime.model import ITEM_INIT_STD, initial_item_rows, task_names
from grstack.runtime.train.context import DistContext, DistEnv
from grstack.runtime.train.trainer import build_engine, make_plan
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_row_does_not_depend_on_the_other_ids_requested():
    full = initial_item_rows(7, torch.arange(500), 24)
    assert full.shape == (500, 24) and full.dtype == torch.float32
    subset = torch.tensor([499, 3, 250, 0, 3, 17])  # any order, repeats included
    assert torch.equal(initial_item_rows(7, subset, 24), full[subset])
    assert torch.equal(initial_item_rows(7, torch.tensor([42]), 24)[0], full[42])
    # int32 ids (or any integer dtype) give the same rows
    assert torch.equal(initial_item_rows(7, subset.to(torch.int32), 24), full[subset])
    # the same call twice is bitwise the same
    assert torch.equal(initial_item_rows(7, torch.arange(500), 24), full)
    # a row's first columns do not depend on the width asked for
    assert torch.equal(initial_item_rows(7, torch.arange(500), 8), full[:, :8])


def test_different_seeds_give_different_rows():
    ids = torch.arange(200)
    a, b = initial_item_rows(0, ids, 16), initial_item_rows(1, ids, 16)
    assert not torch.isclose(a, b).any(dim=1).all()
    # no row of seed 0 reappears for seed 1 (the seed is not a shift of the id)
    assert not (a[1:, None, :] == b[None, :-1, :]).all(dim=2).any()
    assert torch.corrcoef(torch.stack([a.reshape(-1), b.reshape(-1)]))[0, 1].abs() < 0.05


def test_the_rows_are_normal_with_the_models_init_scale():
    rows = initial_item_rows(0, torch.arange(20_000), 64)
    assert torch.isfinite(rows).all()
    assert rows.mean().abs() < 1e-3
    assert abs(rows.std().item() / ITEM_INIT_STD - 1) < 0.02
    assert ITEM_INIT_STD == 0.02
    # a normal shape, not merely the right moments: ~68.3% within one std, ~95.4% within two
    z = rows / ITEM_INIT_STD
    assert abs((z.abs() < 1).float().mean().item() - 0.6827) < 0.01
    assert abs((z.abs() < 2).float().mean().item() - 0.9545) < 0.01
    # every column and every row has the same scale (no degenerate column, no bias per column)
    assert rows.mean(dim=0).abs().max() < 5 * ITEM_INIT_STD / 20_000**0.5 + 1e-4
    assert (rows.std(dim=0) / ITEM_INIT_STD - 1).abs().max() < 0.05
    # neighbouring columns and rows are uncorrelated
    assert torch.corrcoef(torch.stack([rows[:, 0], rows[:, 1]]))[0, 1].abs() < 0.05
    assert torch.corrcoef(torch.stack([rows[:-1].reshape(-1), rows[1:].reshape(-1)]))[0, 1].abs() < 0.01
    # no two rows equal
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]


def test_ids_beyond_32_bits():
    low = torch.tensor([0, 5, 123_456, 2**32 - 1])
    high = low + 2**32
    higher = low + 2**40
    rows = initial_item_rows(3, torch.cat([low, high, higher]), 16)
    assert torch.isfinite(rows).all()
    assert torch.unique(rows, dim=0).shape[0] == 12  # an id above 2^32 is not its low 32 bits
    for i in range(4):
        assert not torch.equal(rows[i], rows[4 + i]) and not torch.equal(rows[4 + i], rows[8 + i])
    # and stays a function of the id alone
    assert torch.equal(initial_item_rows(3, high[1:2], 16)[0], rows[5])


def _assembled(num_rows: int, dim: int, group: int, seed: int = 0) -> torch.Tensor:
    """The table as the shards of a plan with ``group`` ranks initialise it, reassembled (table[s::G])."""
    plan = ShardingPlan.make(num_rows, dim, group, group)
    table = torch.full((num_rows, dim), float("nan"))
    for s in range(group):
        rows = initial_item_rows(seed, plan.global_ids(s, torch.arange(plan.shard_rows(s))), dim)
        assert rows.shape == (plan.shard_rows(s), dim)
        table[s::group] = rows
    return table


@pytest.mark.parametrize("num_rows", [801, 802, 7])
def test_the_initial_table_does_not_depend_on_the_number_of_shards(num_rows):
    whole = initial_item_rows(0, torch.arange(num_rows), 16)
    for group in (1, 2, 3):
        assert torch.equal(_assembled(num_rows, 16, group), whole), group


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic", num_users=40)


def test_the_trainers_shards_assemble_the_same_table_at_every_world_size(data_dir):
    """What the trainer's ranks build (``build_engine``: rank r initialises only shard r) for 1, 2 and 3
    ranks is one and the same initial table, and the same dense part."""
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.seed=11"])
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len)
    tasks = task_names(ds)
    tables, dense = {}, {}
    for world in (1, 2, 3):
        table = None
        for rank in range(world):
            env = DistEnv(rank=rank, world_size=world, local_rank=rank, master_addr="127.0.0.1",
                          master_port=0)
            ctx = DistContext(env, torch.device("cpu"), 0, 60.0, launched=False)  # no process group
            plan = make_plan(cfg, ctx, ds.num_items)
            built = build_engine(cfg, ctx, plan, split, tasks)
            try:
                shard = built.table.weight.detach().clone()
                assert shard.shape == (plan.shard_rows(rank), cfg.model.d_model)
                if table is None:
                    table = torch.full((plan.num_rows, plan.dim), float("nan"))
                table[rank::world] = shard
                if rank == 0:
                    dense[world] = {k: v.clone() for k, v in built.model.state_dict().items()}
            finally:
                built.engine.close()
        tables[world] = table
    assert not torch.isnan(tables[1]).any()
    assert tables[1].shape == (ds.num_items + 1, cfg.model.d_model)
    assert torch.equal(tables[1], initial_item_rows(11, torch.arange(ds.num_items + 1), cfg.model.d_model))
    for world in (2, 3):
        assert torch.equal(tables[world], tables[1]), world
        assert dense[world].keys() == dense[1].keys()
        for k, v in dense[1].items():
            assert torch.equal(dense[world][k], v), (world, k)

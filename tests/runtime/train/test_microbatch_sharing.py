"""Frozen-window micro-batches with intra-batch logit sharing compute what one batch computes, and host
offload frees what it hands back (one rank, in process).

Logit sharing (``negatives.share_k``) is drawn once per rank batch, so with N micro-batches every token scores
the same negative sets as with one: the loss, the gradients and the parameters after a step equal N=1's up
to the order in which float sums are taken (tokens are summed per micro-batch, row gradients accumulate
over micro-batches). Dropout is off because N forward calls draw the dropout masks in another order.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from grstack_testing import tiny_config_args, write_cyclic

from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.model import task_names
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.negatives import HostOffload, share_permutations, step_generator
from grstack.runtime.train.trainer import build_engine, make_plan, train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
# float32 sums in another order: losses (~10) and gradients (dense up to ~1, table rows up to ~4) differ in
# the last few bits (measured: loss 1e-6, dense 5e-7, rows 3e-6, parameters 3e-7 over two steps), so
# absolute 5e-6, relative to the magnitude where it exceeds 1; a wrong negative set moves the loss by ~1e-2
ATOL = 5e-6
SHARING = {"token": ["loss.sharing=token"], "group": ["loss.sharing=group", "loss.group_size=4"]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


@pytest.fixture(scope="module")
def data(data_dir):
    cfg = load_config(CONFIG, tiny_config_args(data_dir))
    ds = load_source(cfg.data)
    return ds, LeaveOneOut(ds, min_len=cfg.data.min_len), task_names(ds)


def _cfg(data_dir, *extra):
    return load_config(CONFIG, [*tiny_config_args(data_dir), "model.dropout=0", "model.input_dropout=0",
                                "train.num_threads=1", "negatives.share_k=3", *extra])


def _built(cfg, data):
    ds, split, tasks = data
    ctx = DistContext.single(torch.device("cpu"))
    return build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items), split, tasks)


def _scored(batch):
    """Every token's (target, the ids of every negative it scores, in scoring order), sorted: what the loss
    of the rank batch is made of, independent of how it is cut into micro-batches."""
    out = []
    for mb in batch.micro:
        units_keys = batch.units[mb.unit].keys
        assert torch.equal(units_keys[mb.inv_neg], mb.neg_ids)  # every set scored is in the lookup unit
        n_own = int(mb.neg_group.max()) + 1
        for p in mb.share:
            assert p.numel() == n_own and int(p.max()) < mb.neg_ids.shape[0]
        for i in range(mb.num_tokens):
            g = int(mb.neg_group[i])
            ids = [mb.neg_ids[g]] + [mb.neg_ids[int(p[g])] for p in mb.share]
            out.append((int(mb.targets[i]), tuple(torch.cat(ids).tolist())))
    return sorted(out)


@pytest.mark.parametrize("sharing", sorted(SHARING))
def test_micro_batches_score_the_negatives_one_batch_scores(data_dir, data, sharing):
    one = _built(_cfg(data_dir, *SHARING[sharing]), data)
    b1 = one.preparer(0, 1, 1)
    (mb,) = b1.micro
    # one micro-batch: its sets are the rank's sets and its maps are the step's permutations, as drawn
    perms = share_permutations(mb.neg_ids.shape[0], 3, step_generator(one.preparer.cfg.train.seed, "share", 1, 0))
    assert len(mb.share) == 2 and all(torch.equal(a, b) for a, b in zip(mb.share, perms, strict=True))
    want = _scored(b1)
    for cluster in ("false", "true"):
        four = _built(_cfg(data_dir, *SHARING[sharing], "pipeline.microbatches=4", f"pipeline.cluster={cluster}"),
                      data)
        b4 = four.preparer(0, 1, 1)
        assert len(b4.micro) == 4
        assert _scored(b4) == want
        # some micro-batch scores sets through sharing that none of its tokens owns
        assert any(m.neg_ids.shape[0] > int(m.neg_group.max()) + 1 for m in b4.micro)
        for b in (one, four):
            b.engine.close()


def _grad_spy(table, record):
    update = table.update

    def spy(keys, grad):
        full = torch.zeros_like(table.weight)
        full.index_add_(0, keys, grad)
        record.append(full)
        return update(keys, grad)

    table.update = spy


def _one_step(cfg, data, steps=2):
    built = _built(cfg, data)
    sparse_grads: list[torch.Tensor] = []
    _grad_spy(built.table, sparse_grads)
    out = []
    try:
        for step in range(steps):
            rec = built.engine.step(built.preparer(0, step, step), None, cfg.optim.lr)
            out.append({"loss": rec["loss"], "microbatches": rec["microbatches"],
                        "dense_grads": {k: p.grad.clone() for k, p in built.model.named_parameters()
                                        if p.grad is not None},
                        "sparse_grad": sparse_grads[-1],
                        "params": {**{k: v.clone() for k, v in built.model.state_dict().items()},
                                   "item_emb.weight": built.table.weight.clone()}})
    finally:
        built.engine.close()
    return out


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("sharing", sorted(SHARING))
def test_micro_batches_with_logit_sharing_equal_one_batch(data_dir, data, sharing):
    ref = _one_step(_cfg(data_dir, *SHARING[sharing]), data)
    for cluster in ("false", "true"):
        got = _one_step(_cfg(data_dir, *SHARING[sharing], "pipeline.microbatches=4", f"pipeline.cluster={cluster}"),
                        data)
        for r, g in zip(ref, got, strict=True):
            assert r["microbatches"] == 1 and g["microbatches"] == 4
            assert abs(r["loss"] - g["loss"]) <= ATOL * max(1.0, abs(r["loss"])), (r["loss"], g["loss"])
            assert _max_diff(r["dense_grads"], g["dense_grads"]) <= ATOL
            scale = float(r["sparse_grad"].abs().max())
            assert scale > 1e-3  # the table did get gradients (up to ~4 here: a row sums many tokens' parts)
            assert float((r["sparse_grad"] - g["sparse_grad"]).abs().max()) <= ATOL * max(1.0, scale)
            assert _max_diff(r["params"], g["params"]) <= ATOL


def test_host_offload_frees_what_it_hands_back():
    off = HostOffload(torch.device("cpu"), fp16=True)
    for _step in range(3):  # a step's worth each time: parked by the prefetch, taken by the micro-batches
        rows = [torch.randn(5, 4) for _ in range(4)]
        slots = [off.park(r, half=u == 0) for u, r in enumerate(rows)]
        assert off.held == 4 and len(set(slots)) == 4
        off.prefetch(slots[1])
        for u, slot in enumerate(slots):
            got = off.take(slot)
            assert got.dtype == torch.float32
            assert torch.equal(got, rows[u]) if u else torch.allclose(got, rows[u], atol=1e-2)
        assert off.held == 0 and not off.parked and not off.loaded
    slots = [off.park(torch.zeros(2, 4)) for _ in range(2)]
    assert min(slots) > 11  # slots are never reused
    off.prefetch(slots[0])
    off.discard(slots)
    assert off.held == 0 and not off.loaded
    with pytest.raises(KeyError):
        off.take(slots[0])


def test_semi_async_steps_hold_only_the_next_batch(data_dir, data):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.num_threads=1", "pipeline.semi_async=true",
                               "pipeline.microbatches=2", "negatives.fp16=true", "loss.sharing=batch"])
    built = _built(cfg, data)
    engine = built.engine
    losses = []
    try:
        batches = [built.preparer(0, s, s) for s in range(7)]
        for t, batch in enumerate(batches):
            upcoming = batches[t + 1] if t + 1 < len(batches) else None
            losses.append(engine.step(batch, upcoming, cfg.optim.lr)["loss"])
            if upcoming is None:
                assert engine.offload.held == 0
            else:
                engine.pending.future.result()
                # the next batch's rows (one slot per lookup unit) and nothing older
                assert sorted(engine.offload.parked) == sorted(engine.pending.parked)
                assert engine.offload.held == len(upcoming.units) == 3
        assert not engine.offload.loaded
    finally:
        engine.close()
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_a_semi_async_run_trains(tmp_path, data_dir):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.num_threads=1", "pipeline.semi_async=true",
                               "pipeline.microbatches=2", "train.epochs=2"])
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["distributed"]["stale_rows"] > 0
    assert summary["metrics"]["test"]["hr@10"] > 0.5  # the ring is learnt (chance is 10/60; measured 0.98)

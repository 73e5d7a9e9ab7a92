"""One trainer for every world size: a one-rank step is the plain PyTorch step, and a config a run cannot
honour is refused with the setting named."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from grstack_testing import (
    cyclic_dataset,
    tiny_config_args,
    with_item_features,
    with_user_context,
    write_cyclic,
)

from grstack.runtime.data.dataset import write_dataset
from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.errors import UserError
from grstack.runtime.model import build_model, item_feature_map, task_names
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.negatives import sampled_softmax_sum
from grstack.runtime.train.trainer import build_engine, make_plan, train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


@pytest.fixture(scope="module")
def feature_dir(tmp_path_factory):
    ds = with_user_context(with_item_features(cyclic_dataset()))
    return write_dataset(ds, tmp_path_factory.mktemp("data") / "featured")


def _plain_step(model, opt, batch, cfg) -> None:
    """The step as one would write it in plain PyTorch: nn.Embedding, AdamW over every parameter, clipping
    over every parameter."""
    (mb,) = batch.micro
    out = model.encode(mb.full)
    q = model.query_vectors(out[mb.is_hist])
    pos = model.item_vectors(mb.targets)
    if mb.neg_ids is None:  # loss.sharing=batch: one set for every token
        neg_ids, group = batch.batch_neg_ids[None], torch.zeros(mb.targets.numel(), dtype=torch.long)
    else:
        neg_ids, group = mb.neg_ids, mb.neg_group
    neg = model.item_vectors(neg_ids.reshape(-1)).reshape(*neg_ids.shape, -1)
    ret = sampled_softmax_sum(q, pos, neg, mb.targets, neg_ids, cfg.loss.temperature, group, mb.share)
    logits = model.rank_logits(out[~mb.is_hist], mb.cand_ids.reshape(-1))
    T = mb.labels.shape[-1]
    labels = mb.labels.reshape(-1, T)
    if cfg.loss.ranking_on == "exposures":  # logged impressions: task 0 (shown) is not trained
        logits, labels, T = logits[:, 1:], labels[:, 1:], T - 1
    bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    loss = ret / batch.global_tokens + cfg.loss.ranking_weight * bce / (batch.global_cands * T)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    opt.step()


@pytest.mark.parametrize(("sharing", "features", "ranking_on"),
                         [("group", False, "uniform"), ("token", False, "uniform"), ("batch", False, "uniform"),
                          ("group", True, "uniform"), ("group", True, "exposures")])
def test_a_one_rank_step_is_the_plain_pytorch_step(data_dir, feature_dir, sharing, features, ranking_on):
    """With side features, user context and action inputs the engine looks each token's feature rows and
    each sequence's context rows up with the item rows and pools them outside the model; the plain model
    reads them from its own table and the batch. Ranking on logged exposures trains the action tasks only."""
    args = [*tiny_config_args(feature_dir if features else data_dir), "model.dropout=0", "model.input_dropout=0",
            "optim.grad_clip=0.05", "optim.weight_decay=0.01", f"loss.sharing={sharing}", "loss.group_size=4"]
    if features:
        args += ['data.item_features=["decade", "parity"]', 'data.user_features=["tags", "cohort"]',
                 "model.action_inputs=true", f"loss.ranking_on={ranking_on}"]
    cfg = load_config(CONFIG, args)
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len, block=cfg.ranking_block())
    tasks = task_names(ds)
    ctx = DistContext.single(torch.device("cpu"))
    fmap = item_feature_map(ds)
    assert (fmap is not None) == features
    users = ds.user_features.sizes if features else None
    built = build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items, fmap, users), split, tasks, item_features=fmap,
                         user_features=users)
    plain = build_model(cfg.model, ds.num_items, cfg.data.max_len, num_tasks=len(tasks), item_features=fmap,
                        user_features=users)
    # the same initial state: the engine's dense part and its (initialised-per-row) item table
    plain.load_state_dict({**built.model.state_dict(), "item_emb.weight": built.table.weight.clone()})
    o = cfg.optim
    opt = torch.optim.AdamW(plain.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    try:
        for step in range(3):
            batch = built.preparer(0, step, step)
            _plain_step(plain, opt, batch, cfg)
            built.engine.step(batch, None, o.lr)
            want = plain.state_dict()
            got = {**built.model.state_dict(), "item_emb.weight": built.table.weight}
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, atol=2e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    finally:
        built.engine.close()


def test_settings_a_run_cannot_honour_are_refused(tmp_path, data_dir):
    args = tiny_config_args(data_dir)
    with pytest.raises(UserError, match=r"sparse_group_size=2 must divide the number of ranks \(1\)"):
        train(load_config(CONFIG, [*args, "distributed.sparse_group_size=2"]), tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists()
    with pytest.raises(UserError, match=r"distributed.sparse_optimizer is now embedding.optimizer"):
        load_config(CONFIG, [*args, "distributed.sparse_optimizer=adam"])
    with pytest.raises(UserError, match=r"negatives.offload .*removed"):
        load_config(CONFIG, [*args, "negatives.offload=false"])

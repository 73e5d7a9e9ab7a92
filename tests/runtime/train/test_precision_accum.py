"""Gradient accumulation and bf16 on one rank: an accumulated update is the plain PyTorch accumulated update,
a bf16 step keeps every weight and optimizer state in fp32, and a run stopped inside an accumulation window
stops at the window's end and resumes to exactly the uninterrupted run."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from grstack_testing import tiny_config_args, write_cyclic

from grstack.runtime.data.source import load_source
from grstack.runtime.data.splits import LeaveOneOut
from grstack.runtime.device import HostSyncCounter
from grstack.runtime.model import build_model, load_exported, task_names
from grstack.runtime.train import checkpoint as ckpt
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.lr_schedule import count_updates, learning_rate
from grstack.runtime.train.negatives import sampled_softmax_sum
from grstack.runtime.train.trainer import build_engine, make_plan, train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"
NO_DROPOUT = ["model.dropout=0", "model.input_dropout=0"]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


def _build(cfg):
    ds = load_source(cfg.data)
    split = LeaveOneOut(ds, min_len=cfg.data.min_len)
    tasks = task_names(ds)
    ctx = DistContext.single(torch.device("cpu"))
    return build_engine(cfg, ctx, make_plan(cfg, ctx, ds.num_items), split, tasks), ds, tasks


def _plain_loss(model, batch, cfg) -> torch.Tensor:
    """The batch's loss as one would write it in plain PyTorch (nn.Embedding for the items); the loss of
    test_one_trainer's ``_plain_step``."""
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
    bce = F.binary_cross_entropy_with_logits(logits, mb.labels.reshape(-1, T), reduction="sum")
    return ret / batch.global_tokens + cfg.loss.ranking_weight * bce / (batch.global_cands * T)


def _engine_state(built) -> dict[str, torch.Tensor]:
    return {**{k: v.detach().clone() for k, v in built.model.state_dict().items()},
            "item_emb.weight": built.table.weight.detach().clone()}


def _assert_state(got, want, atol=2e-6):
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=atol, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


# -- a. accumulation vs plain PyTorch ------------------------------------------------------------------------
def test_an_accumulated_update_is_the_plain_pytorch_accumulated_update(data_dir):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), *NO_DROPOUT, "optim.grad_clip=0.05",
                               "optim.weight_decay=0.01", "train.grad_accum_steps=2"])
    built, ds, tasks = _build(cfg)
    plain = build_model(cfg.model, ds.num_items, cfg.data.max_len, num_tasks=len(tasks))
    plain.load_state_dict({**built.model.state_dict(), "item_emb.weight": built.table.weight.clone()})
    o = cfg.optim
    opt = torch.optim.AdamW(plain.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                            weight_decay=o.weight_decay)
    try:
        for window in range(2):  # the second window checks that the first leaves nothing behind
            b0 = built.preparer(0, 2 * window, 2 * window)
            b1 = built.preparer(0, 2 * window + 1, 2 * window + 1)
            before = _engine_state(built)
            dense_steps = {id(p): s.get("step") for p, s in built.engine.optimizer.state.items()}
            sparse_before = built.table.optimizer.steps
            out0 = built.engine.step(b0, None, o.lr, update=False, grad_scale=0.5)
            assert out0["updated"] is False
            # nothing moved: parameters, the item shard, both optimizers
            _assert_state(_engine_state(built), before, atol=0)
            assert {id(p): s.get("step") for p, s in built.engine.optimizer.state.items()} == dense_steps
            assert built.table.optimizer.steps == sparse_before
            out1 = built.engine.step(b1, None, o.lr, update=True, grad_scale=0.5)
            assert out1["updated"] is True
            assert built.table.optimizer.steps == sparse_before + 1

            opt.zero_grad()
            l0 = _plain_loss(plain, b0, cfg)
            (0.5 * l0).backward()
            l1 = _plain_loss(plain, b1, cfg)
            (0.5 * l1).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.optim.grad_clip)
            opt.step()
            # the engine reports each batch's own (unscaled) loss
            assert out0["loss"] == pytest.approx(l0.item(), rel=1e-5)
            assert out1["loss"] == pytest.approx(l1.item(), rel=1e-5)
            _assert_state(_engine_state(built), plain.state_dict())
    finally:
        built.engine.close()


def test_accumulation_is_not_one_step_per_batch(data_dir):
    """The check above can fail: two separate updates land elsewhere than one accumulated update."""
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), *NO_DROPOUT, "train.grad_accum_steps=2"])
    acc, _, _ = _build(cfg)
    sep, _, _ = _build(cfg)
    lr = cfg.optim.lr
    try:
        b0, b1 = acc.preparer(0, 0, 0), acc.preparer(0, 1, 1)
        acc.engine.step(b0, None, lr, update=False, grad_scale=0.5)
        acc.engine.step(b1, None, lr, update=True, grad_scale=0.5)
        sep.engine.step(b0, None, lr)
        sep.engine.step(b1, None, lr)
        a, s = _engine_state(acc), _engine_state(sep)
        assert max((a[k] - s[k]).abs().max().item() for k in a) > 1e-4
    finally:
        acc.engine.close()
        sep.engine.close()


# -- b. bf16 -------------------------------------------------------------------------------------------------
def test_a_bf16_step_runs_on_cpu_and_keeps_fp32_state(data_dir):
    base = [*tiny_config_args(data_dir), *NO_DROPOUT, "optim.weight_decay=0.01", "optim.grad_clip=1.0"]
    cfg = load_config(CONFIG, base)
    fp32, _, _ = _build(cfg)
    bf16, _, _ = _build(load_config(CONFIG, [*base, "train.precision=bf16"]))
    try:
        assert bf16.engine.bf16 and not fp32.engine.bf16
        _assert_state(_engine_state(bf16), _engine_state(fp32), atol=0)  # the same initial state
        lr = cfg.optim.lr
        for step in range(2):
            batch = fp32.preparer(0, step, step)
            a = fp32.engine.step(batch, None, lr)
            b = bf16.engine.step(batch, None, lr)
            assert torch.isfinite(torch.tensor([b["loss"], b["retrieval_loss"], b["ranking_loss"]])).all()
            assert b["loss"] == pytest.approx(a["loss"], rel=0.03), (step, a["loss"], b["loss"])
            assert b["retrieval_loss"] == pytest.approx(a["retrieval_loss"], rel=0.03)
            assert b["loss"] != a["loss"]  # autocast really ran: bf16 matmuls round differently
            assert isinstance(b["loss"], float)
        # every weight, the item shard and every optimizer state stay fp32
        for name, t in bf16.model.state_dict().items():
            if t.is_floating_point():
                assert t.dtype == torch.float32, name
        for name, p in bf16.model.named_parameters():
            assert p.dtype == torch.float32, name
            if p.grad is not None:
                assert p.grad.dtype == torch.float32, name
        assert bf16.table.weight.dtype == torch.float32
        dense_state = bf16.engine.optimizer.state
        assert len(dense_state) == len(bf16.engine.dense_params)
        for s in dense_state.values():
            assert s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32
        shard_state = bf16.table.optimizer.state_dict()
        assert shard_state["name"] == "adamw" and shard_state["steps"] == 2
        (inner,) = shard_state["inner"]["state"].values()
        assert inner["exp_avg"].dtype == torch.float32 and inner["exp_avg_sq"].dtype == torch.float32
        assert inner["exp_avg"].abs().sum() > 0
        # and the weights moved like the fp32 ones, up to bf16 noise
        got, want = _engine_state(bf16), _engine_state(fp32)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-2, rtol=0.05, msg=lambda m, k=k: f"{k}: {m}")
    finally:
        fp32.engine.close()
        bf16.engine.close()


# -- c. the trainer: windows, stop and resume ----------------------------------------------------------------
def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The parameters and optimizer states of the checkpoint at ``step``, and the exported best model."""
    path = ckpt.step_dir(run_dir, step)
    dense, part = ckpt.load_dense(path), ckpt.load_part(path, 0)
    exported, _, _ = load_exported(run_dir / "model.pt")
    out = {**{f"dense.{k}": v for k, v in dense["model"].items()}, "shard": part["shard"],
           **{f"best.{k}": v for k, v in exported.state_dict().items()}}
    for i, s in dense["optimizer"]["state"].items():
        out.update({f"adamw.{i}.{k}": v for k, v in s.items()})
    (inner,) = part["sparse_optimizer"]["inner"]["state"].values()
    out.update({f"shard_adamw.{k}": v for k, v in inner.items()})
    return out


def test_a_stop_inside_a_window_stops_at_its_end_and_resumes_exactly(tmp_path, data_dir):
    accum, max_steps = 3, 12
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), f"train.grad_accum_steps={accum}",
                               f"train.max_steps={max_steps}", "train.epochs=2", "train.num_threads=1",
                               "train.checkpoint_every=4",  # a checkpoint at the last step too
                               "optim.warmup_steps=1", "optim.schedule=cosine", "optim.min_lr_ratio=0.1"])
    straight = train(cfg, tmp_path / "straight", progress=False)
    recs = [r for r in _records(tmp_path / "straight") if r["kind"] == "train"]
    assert [r["step"] for r in recs] == list(range(1, max_steps + 1))
    # the expected updates: windows of 3 that never cross an epoch, the run's cut window included
    per_epoch = [sum(1 for r in recs if r["epoch"] == e) for e in range(2)]
    steps_in_epoch0 = per_epoch[0]
    assert steps_in_epoch0 % accum != 0 and 0 < per_epoch[1] < steps_in_epoch0  # windows are cut both ways
    want_updated = []
    for r in recs:
        s = r["step"] - 1 - (steps_in_epoch0 if r["epoch"] == 1 else 0)  # 0-based step in its epoch
        want_updated.append((s + 1) % accum == 0 or s + 1 == steps_in_epoch0 or r["step"] == max_steps)
    assert [r["updated"] for r in recs] == want_updated
    updates = sum(want_updated)
    assert straight["optimizer_updates"] == updates
    assert updates == count_updates([steps_in_epoch0, steps_in_epoch0], accum, max_steps)
    assert straight["grad_accum_steps"] == accum and straight["steps"] == max_steps
    # the rate is constant inside a window and follows the schedule over updates
    u = 0
    for r, upd in zip(recs, want_updated, strict=True):
        assert r["lr"] == pytest.approx(learning_rate(u, updates, cfg.optim), rel=1e-12)
        u += upd

    # stop inside the second window ([3, 6)): the run goes on to the window's end
    resumed = tmp_path / "resumed"
    assert train(cfg, resumed, progress=False, stop_after=4) == {"stopped_at_step": 6}
    assert ckpt.latest(resumed) == ckpt.step_dir(resumed, 6)
    assert [r["step"] for r in _records(resumed)] == [1, 2, 3, 4, 5, 6]
    # and inside the first window of epoch 1: to that window's end
    first_e1 = steps_in_epoch0 + 1
    assert train(cfg, resumed, progress=False, stop_after=first_e1) == {
        "stopped_at_step": steps_in_epoch0 + accum}
    final = train(cfg, resumed, progress=False)

    def strip(s: dict) -> dict:  # measurements of the last run's own steps (host_syncs_per_step too)
        return {k: v for k, v in s.items() if k not in ("train_seconds", "samples_per_second",
                                                          "tokens_per_second", "model_path", "distributed",
                                                          "host_syncs_per_step")}

    assert strip(final) == strip(straight)
    # counted on CUDA only (its sync debug mode); the CPU proxy is bench train's
    assert straight["host_syncs_counter"] is None and straight["host_syncs_per_step"] is None
    assert final["metrics"] == straight["metrics"]
    assert final["optimizer_updates"] == updates

    def losses(d):
        return [(r["kind"], r["step"], r.get("loss"), r.get("lr"), r.get("updated"), r.get("hr@10"))
                for r in _records(d)]

    assert losses(resumed) == losses(tmp_path / "straight")
    assert ckpt.latest(resumed) == ckpt.step_dir(resumed, max_steps)
    assert ckpt.latest(tmp_path / "straight") == ckpt.step_dir(tmp_path / "straight", max_steps)
    got, want = _final_tensors(resumed, max_steps), _final_tensors(tmp_path / "straight", max_steps)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_stop_at_a_window_end_stops_there(tmp_path, data_dir):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.grad_accum_steps=3", "train.max_steps=5",
                               "train.epochs=1", "train.num_threads=1"])
    assert train(cfg, tmp_path / "r", progress=False, stop_after=3) == {"stopped_at_step": 3}
    final = train(cfg, tmp_path / "r", progress=False)
    assert final["steps"] == 5 and final["optimizer_updates"] == 2  # [0, 3) and the cut [3, 5)


# -- d. ------------------------------------------------------------------------------------------------------
def test_the_host_sync_counter_counts_nothing_on_cpu():
    with HostSyncCounter(torch.device("cpu")) as c:
        torch.ones(3).sum().item()
    assert c.count is None

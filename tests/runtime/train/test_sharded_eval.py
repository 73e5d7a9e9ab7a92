"""Sharded evaluation ranks every target exactly as one matmul over the whole table does (eval_ranks), with
no rank holding more than its shard: world 1 in process, world 2 (one sparse group of 2, and replicas); and
the trainer built on it: half the table per rank on 2 ranks, an export that evaluates alike, exact resume
(also from a checkpoint written before the best state was sharded)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from grstack_dist_workers import DIST_ENV, sharded_vs_full_ranks
from grstack_testing import (
    assert_same_metrics,
    cyclic_dataset,
    tiny_config_args,
    with_item_features,
    with_user_context,
    write_cyclic,
)

from grstack.runtime.data import LeaveOneOut, read_dataset, write_dataset
from grstack.runtime.eval import evaluate_ranking
from grstack.runtime.eval.evaluate import evaluate
from grstack.runtime.model import exported_state, item_parts_dir, load_exported
from grstack.runtime.train import checkpoint as ckpt
from grstack.runtime.train.context import DistContext
from grstack.runtime.train.launch import call_ranks, train_distributed
from grstack.runtime.train.trainer import train
from grstack.runtime.training_config import load_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"

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


@pytest.mark.unit
def test_side_feature_rows_are_read_by_tokens_and_never_ranked():
    torch.set_num_threads(1)
    ctx = DistContext.single(torch.device("cpu"))
    got = sharded_vs_full_ranks(ctx, {**PAYLOAD, "batch_size": 100, "features": True})
    # 1683 item rows, then parity's 2 values and decade's 170 (d0 .. d169)
    _check(got, 1683 + 2 + 170)
    plain = sharded_vs_full_ranks(ctx, {**PAYLOAD, "batch_size": 100})
    assert not np.array_equal(got["test"]["full"], plain["test"]["full"])  # the features change the queries


@pytest.mark.integration
def test_two_ranks_match_eval_ranks_in_groups_of_two_and_of_one():
    got = call_ranks("grstack_dist_workers:sharded_eval_on_ranks", 2,
                     {**PAYLOAD, "batch_size": 52, "group_sizes": [2, 1]},
                     env=DIST_ENV, limit_s=600)
    for rank in (0, 1):
        _check(got[rank][2], 842 if rank == 0 else 841)  # half the table each
        _check(got[rank][1], 1683)  # groups of one: each rank holds the whole table (a replica)
    assert len(got[0][2]["test"]["full"]) > 2 * len(got[1][2]["test"]["full"])  # uneven round counts


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic", num_users=200, num_items=400)


def _args(data_dir):
    # eval batches of 24 users: several rounds, the last ones uneven between the ranks
    return [*tiny_config_args(data_dir), "train.epochs=2", "train.num_threads=1", "train.checkpoint_every=4",
            "eval.batch_size=24"]


def _exported_metrics(run: Path) -> dict[str, dict]:
    model, cfg, tasks = load_exported(run / "model.pt")
    split = LeaveOneOut(read_dataset(run / "dataset"), min_len=cfg.data.min_len)
    return {w: {**evaluate(model, split, w, max_len=cfg.data.max_len, ks=cfg.eval.ks, batch_size=cfg.eval.batch_size),
                "ranking": evaluate_ranking(model, split, w, tasks, max_len=cfg.data.max_len,
                                            num_candidates=cfg.loss.ranking_candidates, seed=cfg.train.seed,
                                            batch_size=cfg.eval.batch_size)}
            for w in ("valid", "test")}


def _retrieval(metrics: dict[str, dict]) -> dict[str, dict]:
    return {w: {k: v for k, v in m.items() if k != "ranking"} for w, m in metrics.items()}


def _same_export(a: Path, b: Path) -> bool:
    x, y = exported_state(a / "model.pt"), exported_state(b / "model.pt")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _to_old_checkpoint(path: Path, world: int) -> None:
    """Rewrites a checkpoint as one written before the best state was sharded: the whole best table in the
    dense part's ``best_state``, no ``best_shard`` in the rank parts (and, as then, no file digests)."""
    dense = ckpt.load_dense(path)
    parts = [ckpt.load_part(path, r) for r in range(world)]
    shards = [p.pop("best_shard") for p in parts]
    table = shards[0].new_empty((sum(x.shape[0] for x in shards), shards[0].shape[1]))
    for s, x in enumerate(shards):
        table[s::world] = x
    dense["best_state"] = {"item_emb.weight": table, **dense["best_state"]}
    torch.save(dense, path / ckpt.DENSE)
    for r, p in enumerate(parts):
        torch.save(p, path / ckpt.rank_file(r))
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    del manifest["files"]
    (path / ckpt.MANIFEST).write_text(json.dumps({**manifest, "version": 1}))


@pytest.mark.integration
def test_two_rank_training_holds_half_the_table_exports_alike_and_resumes_exactly(tmp_path, data_dir):
    cfg = load_config(CONFIG, _args(data_dir))
    straight = train_distributed(cfg, tmp_path / "straight", nproc=2, progress=False)
    dist = straight["distributed"]
    assert dist["table_rows_max"] == 201 and dist["table_rows_fraction_max"] == 201 / 401 <= 0.55
    (tag,) = list(item_parts_dir(tmp_path / "straight" / "model.pt").iterdir())
    assert sorted(p.name for p in tag.iterdir()) == ["part-00000-of-00002.pt", "part-00001-of-00002.pt"]
    # the export, evaluated in one process over the whole table, gives the summary's retrieval metrics exactly
    # and its ranking metrics (each rank scored its users' candidate sets through the sharded lookup) alike
    exported = _exported_metrics(tmp_path / "straight")
    assert _retrieval(exported) == _retrieval(straight["metrics"])
    assert_same_metrics(exported, straight["metrics"])
    assert straight["metrics"]["test"]["ranking"]["next"]["impressions"] == 200 * 4
    assert 0.05 < straight["metrics"]["test"]["hr@10"] < 1.0  # ranks spread: the comparison means something
    # stopped after the first evaluation (a best state exists) and resumed: the same run, bit for bit
    stop = straight["steps"] // 2 + 3
    for name, old in (("resumed", False), ("resumed-old", True)):
        run = tmp_path / name
        assert train_distributed(cfg, run, nproc=2, progress=False, stop_after=stop)["stopped_at_step"] >= stop
        if old:
            _to_old_checkpoint(ckpt.latest(run), 2)
        resumed = train_distributed(cfg, run, nproc=2, progress=False)
        assert resumed["metrics"] == straight["metrics"] and resumed["best_epoch"] == straight["best_epoch"]
        assert _same_export(run, tmp_path / "straight")
        # an old checkpoint's whole best table was read on every rank: counted
        assert resumed["distributed"]["table_rows_max"] == (401 if old else 201)


@pytest.mark.integration
def test_a_world_of_one_writes_the_one_file_form(tmp_path, data_dir):
    summary = train(load_config(CONFIG, [*_args(data_dir), "train.epochs=1"]), tmp_path / "one", progress=False)
    assert summary["distributed"]["table_rows_fraction_max"] == 1.0
    assert not item_parts_dir(tmp_path / "one" / "model.pt").exists()
    assert "item_emb.weight" in torch.load(tmp_path / "one" / "model.pt", weights_only=True)["state_dict"]
    exported = _exported_metrics(tmp_path / "one")
    assert _retrieval(exported) == _retrieval(summary["metrics"])
    assert_same_metrics(exported, summary["metrics"])


@pytest.mark.integration
def test_two_rank_training_with_side_features_shards_their_rows_and_exports_alike(tmp_path):
    """Item features, user context and action inputs: the trainer's sharded evaluation (retrieval and the
    ranking head) equals the export's, evaluated in one process over the whole table."""
    ds = with_user_context(with_item_features(cyclic_dataset(num_users=200, num_items=400)))
    data = write_dataset(ds, tmp_path / "data")
    cfg = load_config(CONFIG, [*_args(data), "train.epochs=1", 'data.item_features=["parity", "decade"]',
                               'data.user_features=["cohort", "tags"]', "model.action_inputs=true"])
    summary = train_distributed(cfg, tmp_path / "run", nproc=2, progress=False)
    # 401 item rows, parity's 2 values, decade's 42 (d0 .. d41), cohort's 3, tags' 7 (t0 .. t6): half each
    assert summary["distributed"]["table_rows_max"] == 228
    exported = _exported_metrics(tmp_path / "run")
    assert _retrieval(exported) == _retrieval(summary["metrics"])
    assert_same_metrics(exported, summary["metrics"])
    model, _, _ = load_exported(tmp_path / "run" / "model.pt")
    assert model.item_emb.weight.shape[0] == 455 and model.features.sizes == {"parity": 2, "decade": 42}
    assert model.context.sizes == {"cohort": 3, "tags": 7} and model.action_emb.num_embeddings == 2

"""End-to-end training on one machine: learning, exact resume, summary, evaluation CLI, bad input."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from grstack_testing import assert_same_metrics, set_args, tiny_config_args, write_cyclic

from grstack.runtime.cli import main
from grstack.runtime.errors import UserError
from grstack.runtime.train.trainer import train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def test_tiny_run_learns_and_writes_its_artifacts(tmp_path, data_dir):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.epochs=6"])
    summary = train(cfg, tmp_path / "run", progress=False)
    run = tmp_path / "run"
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("model", "dataset", "steps", "epochs", "train_seconds", "samples_per_second",
                "tokens_per_second"):
        assert key in on_disk
    assert set(on_disk["metrics"]["test"]) == {"hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200", "ndcg@200",
                                               "mrr", "ranking"}
    # the ranking head on training-like candidate sets (the cyclic data has no actions: one task)
    for split in ("valid", "test"):
        (task, block), = on_disk["metrics"][split]["ranking"].items()
        assert task == "next" and block["impressions"] == 120 * 4 and block["positives"] == 120
        assert 0.0 <= block["auc"] <= 1.0 and 0.0 <= block["gauc"] <= 1.0 and block["ne"] > 0
        assert block["gauc_users"] == 120 and block["gauc_users_skipped"] == 0 and block["undefined"] == {}
    # the ring is predictable: a trained model ranks the next item near the top, chance is 10/60
    assert on_disk["metrics"]["test"]["hr@10"] > 0.5
    assert (run / "training_curve.png").stat().st_size > 1000
    assert (run / "model.pt").is_file() and (run / "dataset" / "meta.json").is_file()
    losses = [loss for _, loss in _losses(run)]
    assert sum(losses[-5:]) < sum(losses[:5])


def test_full_softmax_trains_through_the_engine(tmp_path, data_dir):
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.epochs=6", "loss.full_softmax=true",
                               "loss.sharing=batch"])
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["metrics"]["test"]["hr@10"] > 0.5  # the ring is learnt with every item a negative
    losses = [loss for _, loss in _losses(tmp_path / "run")]
    assert sum(losses[-5:]) < sum(losses[:5])


def test_eval_cli_reproduces_the_summary(tmp_path, data_dir, capsys):
    run = tmp_path / "run"
    assert main(["train", "--config", str(CONFIG), "--out", str(run), "--no-progress",
                 *set_args(tiny_config_args(data_dir))]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["metrics"]
    want = json.loads((run / "summary.json").read_text())["metrics"]
    assert "ranking" in want["test"]
    assert_same_metrics(got, want)


def test_eval_cli_ranks_the_runs_user_sample_unless_asked_for_all(tmp_path, data_dir, capsys):
    """``eval.max_users``: grstack eval ranks the sample the summary was measured on; --all-users every user."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(CONFIG), "--out", str(run), "--no-progress",
                 *set_args([*tiny_config_args(data_dir), "eval.max_users=7", "train.epochs=1"])]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--json"]) == 0
    sample = json.loads(capsys.readouterr().out)["metrics"]
    assert_same_metrics(sample, json.loads((run / "summary.json").read_text())["metrics"])
    assert sample["test"]["ranking"]["next"]["impressions"] == 7 * 4
    assert main(["eval", "--run", str(run), "--json", "--all-users"]) == 0
    everyone = json.loads(capsys.readouterr().out)["metrics"]
    assert everyone["test"]["ranking"]["next"]["impressions"] == 120 * 4


def test_an_untrained_ranking_head_is_skipped_with_the_reason(tmp_path, data_dir, capsys):
    run = tmp_path / "run"
    cfg = load_config(CONFIG, [*tiny_config_args(data_dir), "train.epochs=1", "loss.ranking_weight=0"])
    summary = train(cfg, run, progress=False)
    why = "loss.ranking_weight is 0: the ranking head was not trained"
    assert summary["metrics"]["test"]["ranking"] == {"skipped": why}
    assert main(["eval", "--run", str(run), "--split", "test"]) == 0
    assert f"test  ranking skipped: {why}" in capsys.readouterr().out


def test_resume_continues_exactly_like_an_uninterrupted_run(tmp_path, data_dir):
    args = [*tiny_config_args(data_dir), "train.checkpoint_every=4"]
    cfg = load_config(CONFIG, args)
    train(cfg, tmp_path / "straight", progress=False)
    # interrupted after step 7 (mid-epoch, between two checkpoints) and resumed from its checkpoint
    stopped = train(load_config(CONFIG, args), tmp_path / "resumed", progress=False, stop_after=7)
    assert stopped == {"stopped_at_step": 7}
    train(load_config(CONFIG, args), tmp_path / "resumed", progress=False)
    assert _losses(tmp_path / "straight") == _losses(tmp_path / "resumed")
    a = torch.load(tmp_path / "straight" / "model.pt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "resumed" / "model.pt", weights_only=False)["state_dict"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((tmp_path / "straight" / "summary.json").read_text())["metrics"]
    sb = json.loads((tmp_path / "resumed" / "summary.json").read_text())["metrics"]
    assert sa == sb


def _cli(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def test_unknown_config_key_is_one_clear_line_and_leaves_nothing(tmp_path, capsys, data_dir):
    out = tmp_path / "run"
    code, err = _cli(capsys, "train", "--config", str(CONFIG), "--out", str(out),
                     "--set", "model.num_layerz=3")
    assert code == 2 and err.count("\n") == 0
    assert "model.num_layerz" in err and "unknown key" in err
    assert not out.exists()


def test_wrong_type_names_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  batch_size: lots\n")
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", str(tmp_path / "r"))
    assert code == 2 and "train.batch_size" in err and str(bad) in err


def test_invalid_yaml_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: 1\n bad: [\n")
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", str(tmp_path / "r"))
    assert code == 2 and "line" in err and "not valid YAML" in err


def test_missing_config_and_missing_data(tmp_path, capsys):
    code, err = _cli(capsys, "train", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r"))
    assert code == 2 and "nope.yaml" in err
    code, err = _cli(capsys, "train", "--config", str(CONFIG), "--out", str(tmp_path / "r"),
                     "--set", "data.format=parquet", "--set", f"data.source={tmp_path / 'missing'}")
    assert code == 2 and "missing" in err and not (tmp_path / "r").exists()


def test_missing_model_for_eval(tmp_path, capsys):
    code, err = _cli(capsys, "eval", "--run", str(tmp_path / "nothing"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, err = _cli(capsys, "eval", "--run", str(tmp_path / "empty"))
    assert code == 2 and "model.pt" in err


def test_resume_with_another_config_is_refused(tmp_path, capsys, data_dir):
    args = tiny_config_args(data_dir)
    train(load_config(CONFIG, args), tmp_path / "run", progress=False, stop_after=2)
    code, err = _cli(capsys, "train", "--config", str(CONFIG), "--out", str(tmp_path / "run"),
                     *set_args([*args, "model.d_model=24"]))
    assert code == 2 and "model.d_model" in err and "another config" in err


def test_a_resume_that_extends_the_run_records_what_it_continues_under(tmp_path, capsys, data_dir):
    """Fields a checkpoint does not pin (here epochs and patience) may change on resume; the run directory's
    config.yaml must then describe the run as continued, and the change is said once."""
    args = tiny_config_args(data_dir)
    train(load_config(CONFIG, args), tmp_path / "run", progress=False, stop_after=2)
    code, err = _cli(capsys, "train", "--config", str(CONFIG), "--out", str(tmp_path / "run"),
                     *set_args([*args, "train.epochs=4", "train.patience=9"]))
    assert code == 0, err
    assert "train.epochs: 3 -> 4" in err and "train.patience: None -> 9" in err
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["epochs"] == 4 and saved["train"]["patience"] == 9
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 4


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys, data_dir):
    args = tiny_config_args(data_dir)
    train(load_config(CONFIG, args), tmp_path / "run", progress=False, stop_after=2)
    for p in (tmp_path / "run" / "checkpoints").rglob("*.pt"):
        p.write_bytes(b"not a checkpoint")
    code, err = _cli(capsys, "train", "--config", str(CONFIG), "--out", str(tmp_path / "run"),
                     *set_args(args))
    assert code == 2 and "sha256 mismatch" in err and err.strip().count("\n") == 0


def test_an_attempt_that_died_before_its_first_checkpoint_starts_over(tmp_path, data_dir):
    """A restarted gang whose first attempt wrote only its preparation must not fail on a non-empty dir."""
    args = tiny_config_args(data_dir)
    run = tmp_path / "run"
    train(load_config(CONFIG, args), run, progress=False, stop_after=2)
    shutil.rmtree(run / "checkpoints")  # as if killed before the first checkpoint reached disk
    summary = train(load_config(CONFIG, args), run, progress=False)
    assert summary["steps"] > 2 and (run / "summary.json").is_file()
    # a different config in the same directory is still refused
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(UserError, match="not empty"):
        train(load_config(CONFIG, [*args, "model.d_model=24"]), run, progress=False)


def test_ranking_on_logged_exposures_end_to_end(tmp_path, capsys):
    """loss.ranking_on=exposures on data with actions: the summary reports the action task on each user's
    held-out block (no 'next'), the checkpoint is chosen on validation click GAUC (logged per evaluation), and
    grstack eval on the export reproduces the summary."""
    from grstack_testing import cyclic_dataset, with_user_context

    from grstack.runtime.data.dataset import write_dataset

    data = write_dataset(with_user_context(cyclic_dataset()), tmp_path / "acted")
    run = tmp_path / "run"
    assert main(["train", "--config", str(CONFIG), "--out", str(run), "--no-progress",
                 *set_args([*tiny_config_args(data), "loss.ranking_on=exposures",
                            "train.select_metric=ranking.click.gauc", "train.epochs=2"])]) == 0
    capsys.readouterr()
    summary = json.loads((run / "summary.json").read_text())
    for split in ("valid", "test"):
        ranking = summary["metrics"][split]["ranking"]
        assert list(ranking) == ["click"]
        users = ranking["click"]["impressions"] // 4
        assert ranking["click"]["impressions"] == users * 4 and users > 50  # 4 logged events per user
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    best = max(evals, key=lambda r: r["ranking.click.gauc"])
    assert summary["best_epoch"] == best["epoch"]
    assert main(["eval", "--run", str(run), "--json"]) == 0
    assert_same_metrics(json.loads(capsys.readouterr().out)["metrics"], summary["metrics"])
    # served, the head gives the trained action columns only
    from grstack.runtime.model import load_exported
    from grstack.runtime.serve import load_ranking_model

    full, _, all_tasks = load_exported(run / "model.pt")
    served, tasks = load_ranking_model(run / "model.pt")
    assert all_tasks == ["next", "click"] and tasks == ["click"] and served.num_tasks == 1
    out, ids = torch.randn(5, full.d_model), torch.arange(1, 6)
    torch.testing.assert_close(served.rank_logits(out, ids), full.rank_logits(out, ids)[:, 1:])


async def test_a_trained_model_with_actions_and_user_context_is_served_exactly(tmp_path):
    """Trained with model.action_inputs and data.user_features, exported, loaded by the ranker with its
    user-feature vocabulary: a request carrying raw feature tokens and action bits is ranked from the cached
    prefix exactly as by full inference."""
    import aiohttp
    import numpy as np
    from grstack_testing import cyclic_dataset, with_user_context

    from grstack.runtime.data.dataset import write_dataset
    from grstack.runtime.serve import load_serving_model
    from grstack.runtime.serve.ranker import RankerConfig, RankerService, start_ranker

    data = write_dataset(with_user_context(cyclic_dataset()), tmp_path / "acted")
    run = tmp_path / "run"
    assert main(["train", "--config", str(CONFIG), "--out", str(run), "--no-progress",
                 *set_args([*tiny_config_args(data), "loss.ranking_on=exposures", "train.epochs=1",
                            'data.user_features=["tags", "cohort"]', "model.action_inputs=true"])]) == 0
    model, tasks, vocab = load_serving_model(run / "model.pt")
    assert set(vocab) == {"tags", "cohort"} and tasks == ["click"]
    service = RankerService(model, tasks, RankerConfig(max_suffix=4, chunk=4), user_vocab=vocab)
    runner, url = await start_ranker(service)
    rng = np.random.default_rng(0)
    items = rng.integers(1, model.num_items + 1, 14).tolist()
    ts = list(range(100, 114))
    acts = rng.integers(0, 2, 14).tolist()
    body = {"user_id": "u1", "long_term": {"items": items[:10], "timestamps": ts[:10], "actions": acts[:10]},
            "short_term": {"items": items[10:], "timestamps": ts[10:], "actions": acts[10:]},
            "candidates": [1, 2, 3], "timestamp": 120,
            "user_features": {"tags": [vocab["tags"][0]], "cohort": [vocab["cohort"][-1]]}}
    try:
        async with aiohttp.ClientSession() as http:
            async def post(path: str, payload: dict) -> dict:
                async with http.post(url + path, json=payload) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            miss = await post("/v1/rank", {**body, "user_id": "u2"})
            await post("/v1/prefill", {k: body[k] for k in ("user_id", "long_term", "user_features")})
            hit = await post("/v1/rank", body)
    finally:
        await runner.cleanup()
    assert miss["cache"] == "miss" and hit["cache"] == "device" and hit["tasks"] == ["click"]
    assert np.abs(np.array(hit["scores"]) - np.array(miss["scores"])).max() <= 1e-5

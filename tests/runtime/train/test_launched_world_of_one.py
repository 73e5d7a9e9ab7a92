"""A launched world of one (``grstack train --nproc 1``: a real gloo process group, every collective runs)
trains exactly as the plain single-process ``grstack train``; and two bf16 ranks on CPU finish a run (the
acceptance check of train.precision=bf16)."""

import json
import math
from pathlib import Path

import pytest
import torch
from grstack_testing import set_args, tiny_config_args, write_cyclic

from grstack.runtime.cli import main

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _numbers(run_dir: Path) -> list[tuple]:
    """What must not depend on how the job was started: per-step losses, rates and eval metrics."""
    out = []
    for r in _records(run_dir):
        if r["kind"] == "train":
            out.append(("train", r["step"], r["loss"], r["retrieval_loss"], r["ranking_loss"], r["lr"],
                        r["updated"], r["refreshed_rows"]))
        else:
            out.append((r["kind"], r["step"], *sorted((k, v) for k, v in r.items() if "@" in k)))
    return out


def test_a_launched_world_of_one_is_the_plain_single_process_run(tmp_path, data_dir):
    args = [*tiny_config_args(data_dir), "train.epochs=2", "pipeline.dbp=true", "train.num_threads=1",
            "train.grad_accum_steps=2", "optim.grad_clip=1.0", "optim.warmup_steps=2",
            "optim.schedule=cosine"]
    base = ["train", "--config", str(CONFIG), "--no-progress", *set_args(args)]
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    assert main([*base, "--out", str(tmp_path / "one"), "--nproc", "1"]) == 0
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert plain["distributed"]["world_size"] == one["distributed"]["world_size"] == 1
    assert one["distributed"]["backend"] == "gloo"
    assert one["steps"] == plain["steps"] > 0 and one["optimizer_updates"] == plain["optimizer_updates"]
    one_recs = [r for r in _records(tmp_path / "one") if r["kind"] == "train"]
    plain_recs = [r for r in _records(tmp_path / "plain") if r["kind"] == "train"]
    # dbp really ran: the prefetched rows of the next batch were refreshed from the update's output
    assert any(r["refreshed_rows"] > 0 for r in one_recs)
    # the launched world's collectives really ran (timed); the plain run's short-circuit (never timed)
    assert all(r["collective_ms"] > 0 for r in one_recs) and all(r["collective_ms"] == 0 for r in plain_recs)
    # bit for bit: the collectives of a world of one (all-reduce, All2All, gathers) change no number
    assert one["metrics"] == plain["metrics"]
    assert _numbers(tmp_path / "one") == _numbers(tmp_path / "plain")
    a = torch.load(tmp_path / "plain" / "model.pt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "one" / "model.pt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_bf16_ranks_finish_the_tiny_config(tmp_path, capsys):
    run = tmp_path / "bf16"
    code = main(["train", "--nproc", "2", "--config", str(CONFIG), "--out", str(run), "--no-progress",
                 *set_args(["train.precision=bf16", "train.max_steps=4", "train.epochs=1",
                            "train.num_threads=1", "train.log_every=1", "eval.max_users=100"])])
    err = capsys.readouterr().err
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["precision"] == "bf16"
    assert summary["distributed"]["world_size"] == 2 and summary["steps"] == 4
    assert summary["optimizer_updates"] == 4
    assert all(math.isfinite(v) for split in summary["metrics"].values() for k, v in split.items() if k != "ranking")
    assert all(math.isfinite(v) for split in summary["metrics"].values() for block in split["ranking"].values()
               for v in (block["auc"], block["gauc"], block["ne"]))
    losses = [r["loss"] for r in _records(run) if r["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert (run / "model.pt").is_file()

"""The launcher's preflight: a job its ranks could not run is one clear error naming the setting, raised
before any rank process starts (and before the run directory exists)."""

from pathlib import Path

import pytest
import torch
from grstack_testing import set_args, write_cyclic

from grstack.runtime.cli import main
from grstack.runtime.errors import UserError
from grstack.runtime.train import launch
from grstack.runtime.train.launch import preflight, train_distributed
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"  # synth tiny: 800 items
SMALL = ["train.num_threads=1"]


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch):
    """Starting a rank fails the test: every refusal must come first."""

    def boom(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(launch, "spawn_local", boom)


def _cfg(*overrides: str):
    return load_config(CONFIG, [*SMALL, *overrides])


def _refused(cfg, nproc: int, pattern: str) -> str:
    with pytest.raises(UserError, match=pattern) as info:
        preflight(cfg, nproc)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message  # one line
    return message


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA machine with one GPU (bf16-capable unless a test says otherwise)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    return monkeypatch


def test_a_job_the_ranks_can_run_passes():
    for nproc in (1, 2, 4):
        assert preflight(_cfg("train.device=cpu"), nproc) is None
    assert preflight(_cfg("train.device=cpu", "distributed.sparse_group_size=2"), 4) is None
    assert preflight(_cfg("train.device=cpu", "train.precision=bf16"), 2) is None  # bf16 autocast on CPU
    assert preflight(_cfg("train.device=cpu", "distributed.max_shard_rows=401"), 2) is None  # 801 rows / 2


def test_nproc_below_one():
    _refused(_cfg(), 0, r"^--nproc must be >= 1, got 0$")


def test_a_batch_smaller_than_the_ranks():
    _refused(_cfg("train.batch_size=1"), 2,
             r"^train\.batch_size=1 is the global batch: it must be at least the number of ranks \(2\)$")
    _refused(_cfg("train.batch_size=3"), 4, r"train\.batch_size=3 .*\(4\)")
    assert preflight(_cfg("train.batch_size=2", "train.device=cpu"), 2) is None


def test_a_sparse_group_size_that_does_not_divide_the_ranks():
    _refused(_cfg("distributed.sparse_group_size=2"), 3,
             r"^distributed\.sparse_group_size=2 must divide the number of ranks \(3\)$")
    _refused(_cfg("distributed.sparse_group_size=4"), 2,
             r"distributed\.sparse_group_size=4 must divide .*\(2\)")


def test_a_shard_limit_the_items_cannot_fit():
    # synth tiny: 800 items + padding = 801 rows; two ranks hold 401 each
    msg = _refused(_cfg("distributed.max_shard_rows=400"), 2,
                   r"801 rows over sparse groups of 2 rank\(s\) need 401 rows per rank, but "
                   r"distributed\.max_shard_rows=400")
    assert "sparse_group_size" in msg  # and what to change
    _refused(_cfg("distributed.max_shard_rows=100", "distributed.sparse_group_size=1"), 2,
             r"need 801 rows per rank.*max_shard_rows=100")


def test_a_shard_limit_is_checked_against_a_parquet_datasets_metadata(tmp_path):
    data = write_cyclic(tmp_path / "cyclic", num_users=20, num_items=60)  # 61 rows
    over = ["data.format=parquet", f"data.source={data}", "train.device=cpu", "loss.negatives=16"]  # <= 60 items
    _refused(_cfg(*over, "distributed.max_shard_rows=30"), 2, r"61 rows .* need 31 rows per rank")
    assert preflight(_cfg(*over, "distributed.max_shard_rows=31"), 2) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it():
    _refused(_cfg("train.device=cuda"), 1, r"^device 'cuda' requested but CUDA is not available$")
    _refused(_cfg("train.device=cuda:0"), 1, r"device 'cuda:0' requested but CUDA is not available")


def test_more_local_ranks_than_gpus(fake_cuda):
    for device in ("auto", "cuda"):
        cfg = _cfg(f"train.device={device}")
        assert preflight(cfg, 1) is None  # one rank, one GPU
        msg = _refused(cfg, 2, r"^LOCAL_RANK=1 needs a cuda device of its own, but this machine \(or pod\) "
                               r"has 1; start at most 1 ranks per machine$")
        assert "LOCAL_RANK" in msg
    fake_cuda.setattr(torch.cuda, "device_count", lambda: 4)
    assert preflight(_cfg("train.device=cuda"), 4) is None
    _refused(_cfg("train.device=cuda"), 5, r"LOCAL_RANK=4 needs a cuda device of its own.* has 4")


def test_bf16_on_a_gpu_without_it(fake_cuda):
    fake_cuda.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    _refused(_cfg("train.device=cuda", "train.precision=bf16"), 1,
             r"^train\.precision=bf16: Tesla V100-SXM2-16GB has no bfloat16 support "
             r".*use train\.precision=fp32")
    assert preflight(_cfg("train.device=cuda", "train.precision=fp32"), 1) is None
    # the precision is refused even where the GPU count would be too (the first mistake is reported)
    _refused(_cfg("train.device=cuda", "train.precision=bf16"), 2, r"^train\.precision=bf16")


def test_train_distributed_refuses_before_starting_anything(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"train\.batch_size=1 is the global batch"):
        train_distributed(_cfg("train.batch_size=1"), run, nproc=2, progress=False)
    with pytest.raises(UserError, match=r"distributed\.max_shard_rows=10"):
        train_distributed(_cfg("distributed.max_shard_rows=10"), run, nproc=2, progress=False)
    assert not run.exists()


def test_the_cli_exits_2_with_one_error_line_and_no_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--config", str(CONFIG), "--out", str(run), "--nproc", "2", "--no-progress",
                 *set_args([*SMALL, "train.batch_size=1"])])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "train.batch_size=1" in lines[0] and "(2)" in lines[0]
    assert not run.exists()
    # a world of one is launched too (--nproc 1), and refused the same way
    code = main(["train", "--config", str(CONFIG), "--out", str(run), "--nproc", "1", "--no-progress",
                 *set_args([*SMALL, "distributed.sparse_group_size=2"])])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "sparse_group_size=2" in err
    assert not run.exists()


def test_more_negatives_than_items(tmp_path):
    data = write_cyclic(tmp_path / "cyclic", num_users=20, num_items=60)
    over = ["data.format=parquet", f"data.source={data}", "train.device=cpu"]
    _refused(_cfg(*over, "loss.negatives=61"), 2, r"loss.negatives=61 is more than the 60 items")
    assert preflight(_cfg(*over, "loss.negatives=60"), 2) is None
    assert preflight(_cfg(*over, "loss.negatives=61", "loss.full_softmax=true",
                          "loss.sharing=batch"), 2) is None


@pytest.mark.parametrize("device", ["cuda:0", "npu:1", "cuda:3"])
def test_an_accelerator_index_with_several_local_ranks(device):
    """Told from the config string alone: no accelerator is needed here to refuse it."""
    kind = device.split(":")[0]
    msg = _refused(_cfg(f"train.device={device}"), 2,
                   rf"^train\.device={device} with --nproc 2: each local rank takes its own accelerator "
                   rf"\(local rank i uses {kind}:i\); use train\.device={kind}$")
    assert "error" not in msg
    _refused(_cfg(f"train.device={device}"), 8, rf"train\.device={device} with --nproc 8")


def test_an_accelerator_index_with_one_local_rank_is_that_accelerator(fake_cuda):
    assert preflight(_cfg("train.device=cuda:0"), 1) is None
    # a pod of a multi-pod job running one local rank: its index is fine too
    assert preflight(_cfg("train.device=cuda:0"), 1, world=4) is None


def test_the_cli_refuses_an_accelerator_index_with_nproc_2(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--config", str(CONFIG), "--out", str(run), "--nproc", "2", "--no-progress",
                 *set_args([*SMALL, "train.device=cuda:0"])])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert "train.device=cuda:0 with --nproc 2" in err and "use train.device=cuda" in err
    assert not run.exists()

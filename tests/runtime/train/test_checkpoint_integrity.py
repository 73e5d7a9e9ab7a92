"""A checkpoint cannot run code and cannot be swapped silently: the manifest records every file's sha256 and
its format version; resume checks each file before parsing it and reads it with the restricted unpickler.
Older manifests (no digests) still resume; newer ones are refused with what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from grstack_testing import set_args, tiny_config_args, write_cyclic

from grstack.runtime.cli import main
from grstack.runtime.errors import UserError
from grstack.runtime.model.torch_files import file_sha256
from grstack.runtime.train import checkpoint as ckpt
from grstack.runtime.train.trainer import train
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "synthetic-tiny-hstu.yaml"


class Payload:
    """Unpickled, it writes ``marker`` (an attacker's ``__reduce__``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_cyclic(tmp_path_factory.mktemp("data") / "cyclic")


def _args(data_dir: Path) -> list[str]:
    return [*tiny_config_args(data_dir), "train.checkpoint_every=4", "train.epochs=2"]


def _stopped_run(data_dir: Path, run: Path) -> Path:
    """A run stopped after step 9 (an evaluation behind it): its latest checkpoint."""
    train(load_config(CONFIG, _args(data_dir)), run, progress=False, stop_after=9)
    path = ckpt.latest(run)
    assert path is not None
    return path


def _set_manifest(path: Path, **changes) -> None:
    m = json.loads((path / ckpt.MANIFEST).read_text())
    m.update(changes)
    (path / ckpt.MANIFEST).write_text(json.dumps(m))


def _resume(data_dir: Path, run: Path, capsys) -> tuple[int, str]:
    code = main(["train", "--config", str(CONFIG), "--out", str(run), *set_args(_args(data_dir))])
    return code, capsys.readouterr().err.strip()


def test_the_manifest_records_every_files_digest_and_version(tmp_path, data_dir):
    path = _stopped_run(data_dir, tmp_path / "run")
    m = json.loads((path / ckpt.MANIFEST).read_text())
    assert m["version"] == ckpt.VERSION == 2
    assert m["files"] == {n: file_sha256(path / n) for n in (ckpt.DENSE, ckpt.rank_file(0))}
    for name in m["files"]:  # plain content: the restricted unpickler reads each file
        assert isinstance(torch.load(path / name, weights_only=True), dict)


@pytest.mark.parametrize("name", [ckpt.DENSE, ckpt.rank_file(0)], ids=["dense-and-optimizer", "shard"])
def test_a_planted_checkpoint_file_runs_nothing_and_is_refused_by_name(tmp_path, data_dir, capsys, name):
    """Planted alone, the file fails its digest; with the manifest rewritten to match (an attacker who can
    write the whole directory), the restricted unpickler refuses it. Nothing runs either way."""
    run = tmp_path / "run"
    path = _stopped_run(data_dir, run)
    marker = tmp_path / "MARKER"
    torch.save({"model": {"w": Payload(marker)}, "shard": Payload(marker)}, path / name)
    code, err = _resume(data_dir, run, capsys)
    assert code == 2 and err.count("\n") == 0 and str(path / name) in err and "sha256 mismatch" in err
    files = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    _set_manifest(path, files={**files, name: file_sha256(path / name)})
    code, err = _resume(data_dir, run, capsys)
    assert code == 2 and err.count("\n") == 0 and str(path / name) in err
    assert "Python callable" in err and "nothing in it was run" in err
    assert not marker.exists()


def test_a_substituted_shard_is_refused_by_name(tmp_path, data_dir):
    """A well-formed shard of another checkpoint of the same run in place of this one's."""
    run = tmp_path / "run"
    path = _stopped_run(data_dir, run)
    earlier = ckpt.list_complete(run)[0]
    assert earlier != path
    shard = path / ckpt.rank_file(0)
    shard.write_bytes((earlier / ckpt.rank_file(0)).read_bytes())
    with pytest.raises(UserError, match=r"checkpoint shard .*rank-00000\.pt: sha256 mismatch") as exc:
        ckpt.load_part(path, 0)
    assert "\n" not in exc.value.message
    assert torch.equal(ckpt.load_part(earlier, 0)["shard"], torch.load(shard, weights_only=True)["shard"])


def test_a_manifest_without_a_files_digest_is_refused(tmp_path, data_dir):
    path = _stopped_run(data_dir, tmp_path / "run")
    files = json.loads((path / ckpt.MANIFEST).read_text())["files"]
    del files[ckpt.DENSE]
    _set_manifest(path, files=files)
    with pytest.raises(UserError, match=r"lists no digest for dense\.pt"):
        ckpt.load_dense(path)


def test_an_older_checkpoint_without_digests_still_resumes(tmp_path, data_dir):
    """(A run directory holding a checkpoint is always resumed, never restarted: the run finishing with the
    uninterrupted run's metrics means the version-1 checkpoint was read.)"""
    straight = train(load_config(CONFIG, _args(data_dir)), tmp_path / "straight", progress=False)
    run = tmp_path / "run"
    path = _stopped_run(data_dir, run)
    m = json.loads((path / ckpt.MANIFEST).read_text())
    del m["files"]
    (path / ckpt.MANIFEST).write_text(json.dumps({**m, "version": 1}))
    resumed = train(load_config(CONFIG, _args(data_dir)), run, progress=False)
    assert resumed["metrics"] == straight["metrics"]


def test_a_newer_checkpoint_format_says_what_to_do(tmp_path, data_dir, capsys):
    run = tmp_path / "run"
    path = _stopped_run(data_dir, run)
    _set_manifest(path, version=99)
    code, err = _resume(data_dir, run, capsys)
    assert code == 2 and err.count("\n") == 0 and "format version 99" in err and "new --out" in err

"""A model file cannot run code: every torch file grstack reads goes through the restricted unpickler, a
planted pickle is refused by name with nothing run; digests refuse corrupted or substituted files; older
formats still load (safely), newer ones are refused with what to do."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from grstack.runtime.cli import main
from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.errors import UserError
from grstack.runtime.model import (
    build_model,
    export_model,
    export_parts,
    item_parts_dir,
    load_exported,
    write_item_part,
)
from grstack.runtime.model.artifact import FORMAT, PART_FORMAT
from grstack.runtime.serve.artifact import load_serving_model
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit


class Payload:
    """Unpickled, it writes ``marker``: what an attacker's ``__reduce__`` would do (``os.system`` alike)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def plant(path: Path, marker: Path, *, raw: bool = False, fmt: str = FORMAT) -> None:
    """``path`` replaced by a malicious file shaped like a grstack one: a torch zip file, or a bare pickle."""
    blob = {"format": fmt, "version": 3, "state_dict": {"w": Payload(marker)}}
    if raw:
        path.write_bytes(pickle.dumps(blob, protocol=2))
    else:
        torch.save(blob, path)


def one_line_naming(exc: pytest.ExceptionInfo[UserError], path: Path) -> str:
    msg = exc.value.message
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def _setup(seed: int = 0):
    cfg = Config.model_validate({"name": "safe", "data": {"format": "parquet", "source": "(none)", "max_len": 10},
                                 "model": {"type": "hstu", "d_model": 8, "num_blocks": 1, "num_heads": 2,
                                           "dqk": 4, "dv": 4, "ranking_head": True}})
    ds = from_sequences([0], [np.array([1, 2, 3])], [np.array([1, 2, 3])], num_items=40)
    torch.manual_seed(seed)
    return cfg, ds, build_model(cfg.model, 40, 10, num_tasks=1)


def _export_in_parts(model, cfg, ds, path: Path, tag: str, G: int) -> None:
    state = model.state_dict()
    table = state.pop("item_emb.weight")
    digests = [write_item_part(path, tag, k, G, table[k::G].clone()) for k in range(G)]
    export_parts(state, cfg, ds, path, tag, G, table.shape[0], digests)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x, y = a.state_dict(), b.state_dict()
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_the_planted_payload_really_runs_when_unpickled_plainly(tmp_path):
    """The payload the other tests plant is live: a plain unpickler runs it (so their 'nothing ran' means
    the loader refused it)."""
    marker = tmp_path / "MARKER"
    plant(tmp_path / "evil.pt", marker)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("raw", [False, True], ids=["torch-zip", "bare-pickle"])
def test_a_planted_model_file_runs_nothing_and_is_refused_by_name(tmp_path, raw):
    marker = tmp_path / "MARKER"
    path = tmp_path / "model.pt"
    plant(path, marker, raw=raw)
    for load in (load_exported, load_serving_model):
        with pytest.raises(UserError) as exc:
            load(path)
        msg = one_line_naming(exc, path)
        assert "Python callable" in msg and "exec" in msg and "nothing in it was run" in msg
    assert not marker.exists()


def test_a_planted_item_part_runs_nothing_even_with_a_matching_digest(tmp_path):
    """Replaced alone, the part fails its digest; with ``model.pt`` rewritten to record the planted file's
    digest too (an attacker who can write both), the restricted unpickler still refuses it."""
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    _export_in_parts(model, cfg, ds, path, "t", 2)
    part = item_parts_dir(path) / "t" / "part-00001-of-00002.pt"
    marker = tmp_path / "MARKER"
    plant(part, marker, fmt=PART_FORMAT)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "sha256 mismatch" in one_line_naming(exc, part)

    from grstack.runtime.model.artifact import DIGEST_KEY
    from grstack.runtime.model.torch_files import content_sha256, file_sha256

    blob = torch.load(path, weights_only=True)
    blob["item_parts"]["sha256"][1] = file_sha256(part)
    del blob[DIGEST_KEY]
    blob[DIGEST_KEY] = content_sha256(blob)
    torch.save(blob, path)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "Python callable" in one_line_naming(exc, part)
    assert not marker.exists()


def test_an_altered_model_file_is_refused_by_its_digest(tmp_path):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    export_model(model, cfg, ds, path)
    blob = torch.load(path, weights_only=True)
    blob["state_dict"]["item_emb.weight"][3, 0] += 1.0  # well formed, one weight changed
    torch.save(blob, path)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "sha256 mismatch" in one_line_naming(exc, path)
    del blob["sha256"]
    torch.save(blob, path)
    with pytest.raises(UserError, match="carries no sha256"):
        load_exported(path)


def test_a_substituted_item_part_is_refused_by_name(tmp_path):
    """A well-formed part of another export (same shape, other weights) in place of the right one."""
    cfg, ds, model = _setup(seed=0)
    _, _, other = _setup(seed=1)
    path, elsewhere = tmp_path / "a" / "model.pt", tmp_path / "b" / "model.pt"
    _export_in_parts(model, cfg, ds, path, "t", 3)
    _export_in_parts(other, cfg, ds, elsewhere, "t", 3)
    name = "part-00002-of-00003.pt"
    (item_parts_dir(path) / "t" / name).write_bytes((item_parts_dir(elsewhere) / "t" / name).read_bytes())
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "sha256 mismatch" in one_line_naming(exc, item_parts_dir(path) / "t" / name)
    assert _same(load_exported(elsewhere)[0], other)


def test_a_truncated_model_file_is_one_line(tmp_path):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    export_model(model, cfg, ds, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "cannot be read" in one_line_naming(exc, path)


def _old_blob(model, cfg, ds) -> dict:
    """What grstack wrote before digests (format version 1): the same keys, no sha256."""
    return {"format": FORMAT, "version": 1, "config": cfg.model_dump(mode="json"), "num_items": ds.num_items,
            "tasks": ["next"], "state_dict": model.state_dict()}


def test_older_formats_still_load_through_the_restricted_unpickler(tmp_path):
    cfg, ds, model = _setup()
    one = tmp_path / "one" / "model.pt"
    one.parent.mkdir()
    torch.save(_old_blob(model, cfg, ds), one)
    loaded, got_cfg, tasks = load_exported(one)
    assert _same(loaded, model) and got_cfg == cfg and tasks == ["next"]
    # version 2: dense weights naming parts, no digests
    parts = tmp_path / "parts" / "model.pt"
    state = model.state_dict()
    table = state.pop("item_emb.weight")
    files = []
    for k in range(2):
        f = item_parts_dir(parts) / "t" / f"part-{k:05d}-of-00002.pt"
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": PART_FORMAT, "shard": k, "group_size": 2, "rows": table[k::2].clone()}, f)
        files.append(f.relative_to(parts.parent).as_posix())
    old = {**_old_blob(model, cfg, ds), "version": 2, "state_dict": state,
           "item_parts": {"group_size": 2, "num_rows": table.shape[0], "files": files}}
    torch.save(old, parts)
    assert _same(load_exported(parts)[0], model)


@pytest.mark.parametrize("version", [99, "3"])
def test_a_newer_or_unknown_format_says_what_to_do(tmp_path, version):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    torch.save({**_old_blob(model, cfg, ds), "version": version}, path)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "re-export" in one_line_naming(exc, path)


def test_a_malformed_model_file_is_one_line(tmp_path):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    blob = _old_blob(model, cfg, ds)
    del blob["tasks"]
    torch.save(blob, path)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "malformed" in one_line_naming(exc, path)
    torch.save([1, 2, 3], path)
    with pytest.raises(UserError) as exc:
        load_exported(path)
    assert "not the dict grstack writes" in one_line_naming(exc, path)


def test_a_planted_simulation_log_runs_nothing(tmp_path, capsys):
    """``bench simulate --from-log`` reads a torch file too."""
    marker = tmp_path / "MARKER"
    log = tmp_path / "log.pt"
    plant(log, marker)
    assert main(["bench", "simulate", "--quick", "--from-log", str(log)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(log) in err and "Python callable" in err
    assert not marker.exists()

"""The exported model's two forms: one file, or dense weights naming the item table's row parts (a sharded
run's export); load_exported reads both and reassembles the parts, older part folders are removed."""

import numpy as np
import pytest
import torch

from grstack.runtime.data.dataset import from_sequences
from grstack.runtime.errors import UserError
from grstack.runtime.model import (
    build_model,
    export_model,
    export_parts,
    exported_state,
    item_parts_dir,
    load_exported,
    write_item_part,
)
from grstack.runtime.training_config import Config

pytestmark = pytest.mark.unit


def _setup():
    cfg = Config.model_validate({"name": "parts", "data": {"format": "parquet", "source": "(none)", "max_len": 10},
                                 "model": {"type": "hstu", "d_model": 8, "num_blocks": 1, "num_heads": 2,
                                           "dqk": 4, "dv": 4}})
    ds = from_sequences([0], [np.array([1, 2, 3])], [np.array([1, 2, 3])], num_items=40)
    torch.manual_seed(0)
    return cfg, ds, build_model(cfg.model, 40, 10)


def _export_in_parts(model, cfg, ds, path, tag, G):
    state = model.state_dict()
    table = state.pop("item_emb.weight")
    for k in range(G):  # what each member of a sparse group writes: its rows k, k + G, ...
        write_item_part(path, tag, k, G, table[k::G].clone())
    export_parts(state, cfg, ds, path, tag, G, table.shape[0])


@pytest.mark.parametrize("G", [2, 3, 7])
def test_parts_round_trip_through_load_exported(tmp_path, G):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    _export_in_parts(model, cfg, ds, path, "step-000000003-aa", G)
    blob = torch.load(path, weights_only=True)
    assert "item_emb.weight" not in blob["state_dict"] and blob["version"] == 3
    assert len(blob["item_parts"]["sha256"]) == G and len(blob["sha256"]) == 64
    assert len(list((item_parts_dir(path) / "step-000000003-aa").iterdir())) == G
    loaded, got_cfg, tasks = load_exported(path)
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert got_cfg == cfg and tasks == ["next"]
    # a later export replaces the earlier parts' folder
    _export_in_parts(model, cfg, ds, path, "step-000000009-bb", G)
    assert [p.name for p in item_parts_dir(path).iterdir()] == ["step-000000009-bb"]
    assert torch.equal(exported_state(path)["item_emb.weight"], want["item_emb.weight"])


def test_the_one_file_form_still_loads(tmp_path):
    cfg, ds, model = _setup()
    export_model(model, cfg, ds, tmp_path / "model.pt")
    blob = torch.load(tmp_path / "model.pt", weights_only=True)
    assert blob["version"] == 3 and "item_parts" not in blob
    got = load_exported(tmp_path / "model.pt")[0].state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())


def test_a_missing_part_is_a_user_error(tmp_path):
    cfg, ds, model = _setup()
    path = tmp_path / "model.pt"
    _export_in_parts(model, cfg, ds, path, "t", 2)
    (item_parts_dir(path) / "t" / "part-00001-of-00002.pt").unlink()
    with pytest.raises(UserError, match=r"part-00001-of-00002\.pt, which does not exist"):
        load_exported(path)

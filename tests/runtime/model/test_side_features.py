"""Item side features in the models: the table layout, pooling, cached-prefix exactness, the artefact, and
the config's field selection."""

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset, with_item_features

from grstack import kernels
from grstack.runtime.data import select_features
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.features import FeatureField, Features
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.errors import UserError
from grstack.runtime.model import ItemFeatureMap, build_model, export_model, item_feature_map, load_exported
from grstack.runtime.training_config import Config, DataConfig, ModelConfig

pytestmark = pytest.mark.unit


def _features() -> Features:
    # items 1..4; cat: {a, b}, {b}, {}, {c}; brand: x, x, y, y
    return Features("item", 4, [
        FeatureField("cat", np.array([0, 2, 3, 3, 4]), np.array([1, 2, 2, 3]), np.array(["a", "b", "c"])),
        FeatureField("brand", np.array([0, 1, 2, 3, 4]), np.array([1, 1, 2, 2]), np.array(["x", "y"]))])


def test_feature_values_follow_the_items_in_the_table_and_each_field_is_a_mean():
    fmap = ItemFeatureMap.from_features(_features(), 4)
    assert fmap.sizes == {"cat": 3, "brand": 2} and fmap.num_rows == 5 and fmap.width == 3
    # rows 0..4 items, 5..7 cat a, b, c, 8..9 brand x, y; padding is row 0 at weight 0
    assert fmap.rows.tolist() == [[0, 0, 0], [5, 6, 8], [6, 8, 0], [9, 0, 0], [7, 9, 0]]
    assert fmap.weights.tolist() == [[0, 0, 0], [0.5, 0.5, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=8, num_blocks=1, num_heads=1, dqk=4, dv=4), 4, 10,
                        item_features=fmap)
    w = model.item_emb.weight
    assert w.shape == (10, 8)
    got = model.token_rows(torch.tensor([1, 3]))
    torch.testing.assert_close(got[0], w[1] + 0.5 * (w[5] + w[6]) + w[8])
    torch.testing.assert_close(got[1], w[3] + w[9])
    # retrieval scores items only: the feature rows are not in the catalogue
    assert model.item_vectors().shape == (5, 8)


@pytest.mark.parametrize("kind", ["hstu", "fuxi", "sasrec"])
def test_side_features_get_gradients_and_change_the_outputs(kind):
    fmap = ItemFeatureMap.from_features(_features(), 4)
    cfg = ModelConfig(type=kind, d_model=8, num_blocks=1, num_heads=2, dqk=4, dv=4, dropout=0.0,
                      input_dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, 4, 10, item_features=fmap)
    batch = JaggedBatch(item_ids=torch.tensor([1, 2, 4, 3, 1]), offsets=torch.tensor([0, 3, 5]),
                        timestamps=torch.arange(5))
    out = model.encode(batch)
    out.square().sum().backward()
    g = model.item_emb.weight.grad
    assert g[5:].abs().sum(dim=1).gt(0).all()  # every value some token has is trained
    torch.manual_seed(0)
    plain = build_model(cfg, 4, 10)
    with torch.no_grad():
        plain.load_state_dict({k: (v[:5] if k == "item_emb.weight" else v) for k, v in model.state_dict().items()})
    assert not torch.allclose(plain.encode(batch), out.detach())


@pytest.mark.parametrize("kind", ["hstu", "fuxi"])
def test_cached_prefixes_stay_exact_with_side_features(kind):
    """A candidate's features are read from the model's map at serving time: encode_with_prefix over a
    prefilled prefix equals encode on the whole sequence."""
    fmap = ItemFeatureMap.from_features(_features(), 4)
    torch.manual_seed(0)
    model = build_model(ModelConfig(type=kind, d_model=8, num_blocks=2, num_heads=2, dqk=4, dv=4, dropout=0.0,
                                    input_dropout=0.0), 4, 20, item_features=fmap).eval()
    g = torch.Generator().manual_seed(1)
    batch = JaggedBatch(item_ids=torch.randint(1, 5, (9,), generator=g), offsets=torch.tensor([0, 6, 9]),
                        timestamps=torch.arange(9) * 100)
    full, _ = append_candidates(batch, torch.tensor([[1, 3], [2, 4]]), torch.tensor([2000, 2000]))
    with torch.no_grad():
        want = model.encode(full)
        offs = full.offsets.tolist()
        keys, values, pts, new_rows = [], [], [], []
        for b, p in enumerate([4, 2]):
            s0 = offs[b]
            k, v = model.prefill_kv(full.item_ids[s0:s0 + p], full.timestamps[s0:s0 + p])
            keys.append(k)
            values.append(v)
            pts.append(full.timestamps[s0:s0 + p])
            new_rows += range(s0 + p, offs[b + 1])
        rows = torch.tensor(new_rows)
        lengths = torch.tensor([offs[1] - 4, offs[2] - offs[1] - 2])
        got, _, _ = model.encode_with_prefix(full.item_ids[rows], full.timestamps[rows],
                                             kernels.lengths_to_offsets(lengths), keys, values, pts,
                                             num_targets=full.num_targets)
        torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
        logits = model.rank_logits(got[-2:], torch.tensor([2, 4]))
        torch.testing.assert_close(logits, model.rank_logits(want[rows][-2:], torch.tensor([2, 4])))


def test_the_artefact_carries_the_feature_map(tmp_path):
    ds = with_item_features(cyclic_dataset(num_users=20, num_items=30))
    cfg = Config.model_validate({"data": {"format": "parquet", "source": str(tmp_path),
                                          "item_features": ["decade"]},
                                 "model": {"d_model": 8, "num_blocks": 1, "num_heads": 1, "dqk": 4, "dv": 4}})
    ds = select_features(ds, cfg.data)
    fmap = item_feature_map(ds)
    assert fmap is not None and fmap.sizes == {"decade": 5}
    torch.manual_seed(0)
    model = build_model(cfg.model, ds.num_items, cfg.data.max_len, num_tasks=1, item_features=fmap).eval()
    export_model(model, cfg, ds, tmp_path / "model.pt")
    loaded, _, _ = load_exported(tmp_path / "model.pt")
    assert loaded.features.sizes == {"decade": 5}
    assert torch.equal(loaded.features.rows, fmap.rows) and torch.equal(loaded.features.weights, fmap.weights)
    ids = torch.arange(1, 31)
    torch.testing.assert_close(loaded.token_rows(ids), model.token_rows(ids))


def test_the_config_selects_fields_by_name_and_refuses_unknown_ones():
    ds = with_item_features(cyclic_dataset(num_users=10, num_items=12))
    picked = select_features(ds, DataConfig(item_features=["parity"]))
    assert picked.item_features is not None and picked.item_features.names == ["parity"]
    with pytest.raises(UserError, match=r"data.item_features: the dataset has no item feature\(s\) genre "
                                        r"\(its item features: parity, decade\)"):
        select_features(with_item_features(cyclic_dataset(num_users=10, num_items=12)),
                        DataConfig(item_features=["genre"]))
    with pytest.raises(UserError, match=r"data.item_features: the dataset cyclic has no item features"):
        select_features(cyclic_dataset(num_users=10, num_items=12), DataConfig(item_features=["parity"]))
    with pytest.raises(ValueError, match="names a field more than once: parity"):
        DataConfig(item_features=["parity", "parity"])
    assert select_features(with_item_features(cyclic_dataset(num_users=10, num_items=12)),
                           DataConfig()).item_features is None

"""Item side features in the models: the table layout, pooling, cached-prefix exactness, the artefact, and
the config's field selection."""

import numpy as np
import pytest
import torch
from grstack_testing import cyclic_dataset, with_item_features, with_user_context

from grstack import kernels
from grstack.runtime.data import LeaveOneOut, select_features
from grstack.runtime.data.candidates import append_candidates
from grstack.runtime.data.features import FeatureField, Features
from grstack.runtime.data.jagged import JaggedBatch
from grstack.runtime.errors import UserError
from grstack.runtime.model import (
    ItemFeatureMap,
    build_model,
    export_model,
    item_feature_map,
    load_exported,
    task_names,
)
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


def test_a_token_reads_its_own_actions_and_a_candidate_never_its_label():
    ds = with_user_context(cyclic_dataset(num_users=6, num_items=12))
    ds.actions = np.arange(ds.num_events, dtype=np.int64) % 4  # distinct bits per position
    split = LeaveOneOut(ds)
    batch, _ = split.train_batch(np.arange(len(split.train_users)), max_len=50)
    # the same events: a token's own action is the previous token's label inside a sequence
    inner = torch.ones(batch.num_tokens, dtype=torch.bool)
    inner[batch.offsets[:-1]] = False
    assert torch.equal(batch.input_actions[inner], batch.actions[torch.nonzero(inner).squeeze(1) - 1])
    full, is_hist = append_candidates(batch, torch.ones(batch.batch_size, 3, dtype=torch.int64),
                                      torch.zeros(batch.batch_size, dtype=torch.int64))
    assert torch.equal(full.input_actions[is_hist], batch.input_actions)
    assert (full.input_actions[~is_hist] == -1).all()
    model = build_model(ModelConfig(d_model=8, num_blocks=1, num_heads=1, dqk=4, dv=4, action_inputs=True), 12, 50,
                        num_tasks=3)
    e = model.action_emb.weight
    vec = model.action_vectors(torch.tensor([0, 1, 3, -1]))
    torch.testing.assert_close(vec, torch.stack([torch.zeros(8), e[0], e[0] + e[1], e[2]]))


def test_contextual_tokens_head_each_sequence_and_reach_only_their_own():
    ds = with_user_context(cyclic_dataset(num_users=6, num_items=12))
    split = LeaveOneOut(ds)
    batch, _ = split.eval_batch("test", np.arange(4), max_len=50)
    assert batch.context.shape == (4, 2, 2)  # cohort (one value), tags (up to two)
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=8, num_blocks=2, num_heads=2, dqk=4, dv=4, dropout=0.0,
                                    input_dropout=0.0), 12, 50, num_tasks=2,
                        user_features=ds.user_features.sizes).eval()
    assert model.max_seq_len == 50 + 1 + 2
    with torch.no_grad():
        out = model.encode(batch)
        assert out.shape == (batch.num_tokens, 8)
        changed = batch.context.clone()
        changed[1, 0, 0] = 3 - changed[1, 0, 0] if changed[1, 0, 0] != 0 else 1  # user 1's cohort
        other = model.encode(JaggedBatch(item_ids=batch.item_ids, offsets=batch.offsets,
                                         timestamps=batch.timestamps, context=changed))
    seq = torch.repeat_interleave(torch.arange(4), batch.lengths)
    assert not torch.allclose(out[seq == 1], other[seq == 1])
    torch.testing.assert_close(out[seq != 1], other[seq != 1])


def test_an_exported_model_with_user_context_serves_with_its_vocabulary(tmp_path):
    from grstack.runtime.serve.artifact import load_serving_model

    ds = with_user_context(cyclic_dataset(num_users=10, num_items=12))
    cfg = Config.model_validate({"data": {"format": "parquet", "source": str(tmp_path), "user_features": ["cohort"]},
                                 "model": {"d_model": 8, "num_blocks": 1, "num_heads": 1, "dqk": 4, "dv": 4}})
    ds = select_features(ds, cfg.data)
    model = build_model(cfg.model, ds.num_items, cfg.data.max_len, num_tasks=2, user_features=ds.user_features.sizes)
    export_model(model, cfg, ds, tmp_path / "model.pt")
    loaded, _, _ = load_exported(tmp_path / "model.pt")
    assert loaded.context.sizes == {"cohort": 3}
    served, tasks, vocab = load_serving_model(tmp_path / "model.pt")
    assert served.context.sizes == {"cohort": 3} and tasks == task_names(ds)
    assert vocab == {"cohort": [str(t) for t in ds.user_features.fields[0].vocab]} and len(vocab["cohort"]) == 3


def test_action_inputs_need_actions_and_user_context_needs_whole_reads(tmp_path):
    from grstack.runtime.data.dataset import write_dataset
    from grstack.runtime.train.trainer import train

    data = write_dataset(cyclic_dataset(num_users=10, num_items=12), tmp_path / "data")
    cfg = Config.model_validate({"data": {"format": "parquet", "source": str(data)},
                                 "model": {"d_model": 8, "num_blocks": 1, "num_heads": 1, "dqk": 4, "dv": 4,
                                           "action_inputs": True}})
    with pytest.raises(UserError, match=r"model\.action_inputs: the dataset cyclic has no actions to read"):
        train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"data\.user_features needs data\.read=all"):
        Config.model_validate({"data": {"format": "parquet", "source": str(data), "read": "shard",
                                        "user_features": ["cohort"]}})


def test_side_file_paths_resolve_like_the_source(tmp_path, monkeypatch):
    """A side file named in a config file resolves against the config's folder; on the command line, against
    the working directory; ``auto`` stays ``auto``."""
    from grstack.runtime.training_config import load_config

    (tmp_path / "cfg").mkdir()
    cfg_file = tmp_path / "cfg" / "c.yaml"
    cfg_file.write_text("data:\n  format: recbole\n  source: data\n  item_features: [class]\n"
                        "  item_features_file: side/x.item\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(cfg_file)
    assert cfg.data.item_features_file == str(tmp_path / "cfg" / "side" / "x.item")
    assert cfg.data.user_features_file == "auto"
    cli = load_config(cfg_file, ["data.item_features_file=other.item"])
    assert cli.data.item_features_file == str(tmp_path / "other.item")


@pytest.mark.parametrize("kind", ["hstu", "fuxi", "sasrec"])
def test_the_plan_from_host_lengths_counts_the_contextual_tokens(kind):
    """With user context the layers run on C more tokens per sequence: the plan built from the batch's host
    lengths (plus C) gives the outputs the plan read from the offsets does, and reads nothing back."""
    from grstack.kernels import HostSyncCount

    ds = with_user_context(cyclic_dataset(num_users=6, num_items=12))
    batch, _ = LeaveOneOut(ds).eval_batch("test", np.arange(4), max_len=50)
    torch.manual_seed(0)
    model = build_model(ModelConfig(type=kind, d_model=8, num_blocks=2, num_heads=2, dqk=4, dv=4, dropout=0.0,
                                    input_dropout=0.0), 12, 50, num_tasks=2,
                        user_features=ds.user_features.sizes).eval()
    assert model.num_context == 2
    with torch.no_grad(), HostSyncCount("cpu") as syncs:
        out = model.encode(batch)
    assert dict(syncs.by_kind) == {}
    batch.host_lengths = None
    with torch.no_grad():
        assert torch.equal(model.encode(batch), out)

"""The shipped configs: every one validates without its data, none reads outside the repository, and the
paper configs carry the settings of Meta's generative-recommenders gin files they reproduce."""

from __future__ import annotations

from pathlib import Path

import pytest

from grstack.runtime.data.fetch.catalog import lookup
from grstack.runtime.data.source import load_source
from grstack.runtime.errors import UserError
from grstack.runtime.training_config import load_config

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))

# Meta's gin settings (configs/<dataset>/*-final.gin) in grstack's terms, and the README's HR@10 / NDCG@10.
COMMON = {"optim.lr": 1e-3, "optim.weight_decay": 0.0, "optim.warmup_steps": 0, "optim.beta1": 0.9,
          "optim.beta2": 0.98, "loss.temperature": 0.05, "loss.sharing": "token", "train.batch_size": 128,
          "train.patience": None, "data.format": "parquet", "eval.ks": [10, 50, 200]}
PAPER = {
    "ml-1m-sasrec": ({"data.source": "fetched:ml-1m", "data.max_len": 200, "model.type": "sasrec",
                      "model.d_model": 50, "model.num_blocks": 2, "model.num_heads": 1, "model.ffn_mult": 1,
                      "model.dropout": 0.2, "model.input_dropout": 0.2, "loss.negatives": 128,
                      "train.epochs": 101}, "sasrec-sampled-softmax-n128-final.gin", "0.2853", "0.1603"),
    "ml-1m-hstu": ({"data.source": "fetched:ml-1m", "data.max_len": 200, "model.type": "hstu", "model.d_model": 50,
                    "model.num_blocks": 2, "model.num_heads": 1, "model.dqk": 50, "model.dv": 50,
                    "model.dropout": 0.2, "model.input_dropout": 0.2, "loss.negatives": 128, "train.epochs": 101},
                   "hstu-sampled-softmax-n128-final.gin", "0.3097", "0.1720"),
    "ml-1m-hstu-large": ({"data.source": "fetched:ml-1m", "data.max_len": 200, "model.type": "hstu",
                          "model.d_model": 50, "model.num_blocks": 8, "model.num_heads": 2, "model.dqk": 25,
                          "model.dv": 25, "model.dropout": 0.2, "model.input_dropout": 0.2, "loss.negatives": 128,
                          "train.epochs": 101}, "hstu-sampled-softmax-n128-large-final.gin", "0.3294", "0.1893"),
    "ml-20m-hstu-large": ({"data.source": "fetched:ml-20m", "data.max_len": 200, "model.type": "hstu",
                           "model.d_model": 256, "model.num_blocks": 16, "model.num_heads": 8, "model.dqk": 32,
                           "model.dv": 32, "model.dropout": 0.2, "model.input_dropout": 0.2,
                           "loss.negatives": 128, "train.epochs": 101},
                          "hstu-sampled-softmax-n128-large-final.gin", "0.3556", "0.2098"),
    "books-hstu-large": ({"data.source": "fetched:amazon-books", "data.max_len": 50, "model.type": "hstu",
                          "model.d_model": 64, "model.num_blocks": 16, "model.num_heads": 8, "model.dqk": 8,
                          "model.dv": 8, "model.dropout": 0.5, "model.input_dropout": 0.5, "loss.negatives": 512,
                          "train.epochs": 201, "eval.batch_size": 128},
                         "hstu-sampled-softmax-n512-large-final.gin", "0.0478", "0.0262"),
}


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No fetched dataset, whatever the machine's own cache holds."""
    monkeypatch.setenv("GRSTACK_DATA_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _get(cfg: object, dotted: str) -> object:
    for key in dotted.split("."):
        cfg = getattr(cfg, key)
    return cfg


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_validates_and_reads_only_synthetic_or_fetched_data(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name == path.stem
    if cfg.data.format != "synth":
        assert cfg.data.format == "parquet" and cfg.data.source.startswith("fetched:"), cfg.data.source
        lookup(cfg.data.source.removeprefix("fetched:"))  # a dataset `grstack data fetch` knows
    assert cfg.data.item_features_file == cfg.data.user_features_file == "auto"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_configs_carry_metas_settings_and_name_their_anchor(name: str) -> None:
    settings, gin, hr10, ndcg10 = PAPER[name]
    cfg = load_config(CONFIGS / f"{name}.yaml")
    for key, want in {**COMMON, **settings}.items():
        assert _get(cfg, key) == want, key
    if cfg.model.type == "hstu":
        assert cfg.model.time_bias and cfg.model.position_bias and not cfg.model.ranking_head
    assert gin in cfg.protocol and f"HR@10 {hr10}" in cfg.protocol and f"NDCG@10 {ndcg10}" in cfg.protocol


@pytest.mark.parametrize("name", ["ml-1m-hstu-large", "books-hstu-large", "ml-100k-hstu", "beauty-hstu"])
def test_a_config_whose_data_is_not_fetched_says_how_to_fetch_it(name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.yaml")
    dataset = lookup(cfg.data.source.removeprefix("fetched:")).name
    with pytest.raises(UserError, match=rf"run `grstack data fetch {dataset}`"):
        load_source(cfg.data)


def test_data_of_ones_own_replaces_the_fetched_source(tmp_path: Path) -> None:
    """What the tests and benchmarks on raw files do: the format and the path on the command line."""
    cfg = load_config(CONFIGS / "ml-100k-hstu.yaml", ["data.format=recbole", f"data.source={tmp_path / 'ml'}"])
    assert (cfg.data.format, cfg.data.source) == ("recbole", str(tmp_path / "ml"))

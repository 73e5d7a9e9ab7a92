"""Small learnable datasets built in-process (no dependency on the importers or the generator)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset, from_sequences, write_dataset


def cyclic_dataset(num_users: int = 120, num_items: int = 60, min_len: int = 6, max_len: int = 30,
                   seed: int = 0) -> SequenceDataset:
    """Each user walks the item ring with step 1 or 2 (per user): the next item is predictable."""
    rng = np.random.default_rng(seed)
    users, items, ts = [], [], []
    for u in range(num_users):
        n = int(rng.integers(min_len, max_len + 1))
        start = int(rng.integers(0, num_items))
        step = 1 + (u % 2)
        seq = (start + step * np.arange(n)) % num_items + 1
        users.append(u)
        items.append(seq)
        ts.append(1_600_000_000 + np.cumsum(rng.integers(1, 3600, size=n)))
    return from_sequences(users, items, ts, num_items=num_items, name="cyclic")


def write_cyclic(dir_path: Path, **kw) -> Path:
    return write_dataset(cyclic_dataset(**kw), dir_path)


def tiny_config_args(data_dir: Path) -> list[str]:
    """Overrides that turn the tiny synthetic config into a seconds-long run on a parquet dataset."""
    return [
        "data.format=parquet", f"data.source={data_dir}", "data.max_len=20",
        "model.d_model=16", "model.num_blocks=2", "model.num_heads=2", "model.dqk=8", "model.dv=8",
        "model.dropout=0.1", "model.input_dropout=0.1",
        "loss.negatives=16", "loss.ranking_candidates=4", "optim.lr=0.01",
        "train.batch_size=16", "train.epochs=3", "train.log_every=1", "eval.batch_size=64",
    ]


def set_args(overrides: list[str]) -> list[str]:
    """``["a=1", "b=2"]`` -> ``["--set", "a=1", "--set", "b=2"]`` for CLI calls."""
    return [part for o in overrides for part in ("--set", o)]


def assert_same_metrics(got: dict, want: dict, *, abs_tol: float = 1e-9, ranking_abs: float = 1e-6) -> None:
    """``got`` and ``want`` are ``{split: metrics}`` with the same keys; retrieval metrics equal within
    ``abs_tol``; the ranking blocks (``ranking.{task}``) have the same counts, and their AUC/GAUC/NE agree
    within ``ranking_abs`` (two processes' logits may differ in the last bits, which can move a near-tie)."""
    import pytest

    assert got.keys() == want.keys()
    for split in want:
        assert got[split].keys() == want[split].keys(), split
        for k, v in want[split].items():
            if k != "ranking":
                assert got[split][k] == pytest.approx(v, abs=abs_tol), (split, k)
                continue
            assert got[split][k].keys() == v.keys()
            for task, block in v.items():
                mine = got[split][k][task]
                for field, x in block.items():
                    if isinstance(x, float):
                        assert mine[field] == pytest.approx(x, abs=ranking_abs), (split, task, field)
                    else:
                        assert mine[field] == x, (split, task, field)


def with_item_features(ds: SequenceDataset) -> SequenceDataset:
    """``ds`` with two item side features: ``parity`` (one value: item id mod 2) and ``decade`` (two values:
    the item's tens and the next tens; item 7 has none, so an item without values is covered)."""
    from grstack.runtime.data.features import RawFeatures, attach, csr_from_lists

    ids = np.arange(1, ds.num_items + 1)
    parity = csr_from_lists([[str(i % 2)] for i in ids])
    decade = csr_from_lists([[] if i == 7 else [f"d{i // 10}", f"d{i // 10 + 1}"] for i in ids])
    raw = RawFeatures("item", ids, {"parity": parity, "decade": decade}, "test features")
    ds.item_raw_ids = ids.astype(np.int64)
    ds.item_features = attach(raw, ds.item_raw_ids)
    return ds


def with_user_context(ds: SequenceDataset) -> SequenceDataset:
    """``ds`` with user features ``cohort`` (user row mod 3) and ``tags`` (two values, none for every fifth
    user) and a ``click`` action bit on every other event."""
    from grstack.runtime.data.features import RawFeatures, attach, csr_from_lists

    rows = np.arange(ds.num_users)
    cohort = csr_from_lists([[str(r % 3)] for r in rows])
    tags = csr_from_lists([[] if r % 5 == 0 else [f"t{r % 4}", f"t{r % 7}"] for r in rows])
    raw = RawFeatures("user", ds.user_ids, {"cohort": cohort, "tags": tags}, "test user features")
    ds.user_features = attach(raw, ds.user_ids)
    ds.actions = (np.arange(ds.num_events) % 2).astype(np.int64)
    ds.action_names = ["click"]
    return ds

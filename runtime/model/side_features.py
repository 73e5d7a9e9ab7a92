"""Item side features pooled into item tokens (docs/features.md).

Feature values are rows of the item table itself, after the items: table row ``num_items + 1 + base_f + v - 1``
is value ``v`` of field ``f`` (``base_f`` the values of the fields before it). So the distributed engine
shards, looks up, updates and exports them exactly as it does item rows, with one lookup per batch.

An item token's row is its item row plus, per field, the mean of its values' rows (a field with several
values, e.g. categories, weighs as much as a single-valued one, e.g. brand). The retrieval head scores
against item rows alone, as FDSA and DIF-SR do: full-catalogue scoring and sampled negatives touch no
feature rows, so a sharded evaluation needs nothing but the item rows it owns.

:class:`ItemFeatureMap` is the per-item layout: ``rows[i]`` the table rows of item ``i``'s values, padded
with row 0 at weight 0 to the widest item (``[num_items + 1, W]``, fixed width: lookups need no host
sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn


class _FieldLike(Protocol):
    name: str
    offsets: np.ndarray
    values: np.ndarray

    @property
    def num_values(self) -> int: ...


class _FeaturesLike(Protocol):
    num_rows: int
    fields: list[Any]


@dataclass
class ItemFeatureMap:
    """Per item, the table rows of its feature values and their pooling weights."""

    sizes: dict[str, int]  # field -> number of values, in table order
    rows: torch.Tensor  # [num_items + 1, W] int64 (0: no value)
    weights: torch.Tensor  # [num_items + 1, W] float32 (1 / values of that field the item has; 0: padding)

    @property
    def num_items(self) -> int:
        return self.rows.shape[0] - 1

    @property
    def num_rows(self) -> int:
        """Table rows the feature values take (after the ``num_items + 1`` item rows)."""
        return sum(self.sizes.values())

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    @classmethod
    def from_features(cls, feats: _FeaturesLike, num_items: int) -> ItemFeatureMap:
        """From a dataset's item features (rows are items ``1..num_items``)."""
        if feats.num_rows != num_items:
            raise ValueError(f"item features cover {feats.num_rows} items, the table {num_items}")
        first = num_items + 1
        per_item_rows: list[np.ndarray] = []
        per_item_w: list[np.ndarray] = []
        counts = np.zeros(num_items, dtype=np.int64)
        base = first
        for f in feats.fields:
            n = np.diff(f.offsets)
            item_of = np.repeat(np.arange(num_items), n)
            per_item_rows.append(np.stack([item_of, base + f.values - 1]))
            per_item_w.append(1.0 / n[item_of])
            counts += n
            base += f.num_values
        width = max(1, int(counts.max()) if num_items else 1)
        rows = np.zeros((num_items + 1, width), dtype=np.int64)
        weights = np.zeros((num_items + 1, width), dtype=np.float32)
        if per_item_rows:
            pairs = np.concatenate(per_item_rows, axis=1)
            w = np.concatenate(per_item_w)
            order = np.argsort(pairs[0], kind="stable")
            item_of, table_row, w = pairs[0][order], pairs[1][order], w[order]
            starts = np.zeros(num_items + 1, dtype=np.int64)
            np.cumsum(counts, out=starts[1:])
            slot = np.arange(len(item_of)) - starts[item_of]
            rows[item_of + 1, slot] = table_row
            weights[item_of + 1, slot] = w
        return cls({f.name: int(f.num_values) for f in feats.fields}, torch.from_numpy(rows),
                   torch.from_numpy(weights))

    def to_blob(self) -> dict[str, Any]:
        """What the exported artefact stores to rebuild it."""
        return {"sizes": dict(self.sizes), "rows": self.rows.cpu(), "weights": self.weights.cpu()}

    @classmethod
    def from_blob(cls, blob: dict[str, Any]) -> ItemFeatureMap:
        return cls(dict(blob["sizes"]), blob["rows"].long(), blob["weights"].float())

    def token_keys(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[n, 1 + W] the table rows an item token reads: its item row, then its feature rows."""
        rows = self.rows.to(item_ids.device)
        return torch.cat([item_ids[:, None], rows[item_ids]], dim=1)


class ItemFeatureBag(nn.Module):
    """The model's copy of an :class:`ItemFeatureMap` (device buffers, not weights: the artefact carries the
    map beside the state dict) and the pooling."""

    def __init__(self, fmap: ItemFeatureMap) -> None:
        super().__init__()
        self.sizes = dict(fmap.sizes)
        self.register_buffer("rows", fmap.rows.clone(), persistent=False)
        self.register_buffer("weights", fmap.weights.clone(), persistent=False)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes.values())

    def feature_map(self) -> ItemFeatureMap:
        return ItemFeatureMap(dict(self.sizes), self.rows.cpu(), self.weights.cpu())

    def token_keys(self, item_ids: torch.Tensor) -> torch.Tensor:
        """On ``item_ids``' device (host ids for a sharded lookup stay on the host)."""
        rows = self.rows[item_ids.to(self.rows.device)].to(item_ids.device)
        return torch.cat([item_ids[:, None], rows], dim=1)

    def pool(self, item_ids: torch.Tensor, looked: torch.Tensor) -> torch.Tensor:
        """[n, d] token rows from ``looked`` [n, 1 + W, d], the rows of :meth:`token_keys`."""
        w = self.weights[item_ids.to(self.weights.device)].to(device=looked.device, dtype=looked.dtype)
        return looked[:, 0] + torch.einsum("nw,nwd->nd", w, looked[:, 1:])


class ItemTokens(nn.Module):
    """The item table (item rows, then feature-value rows) and what an item token reads of it; HSTU and
    SASRec keep theirs in ``item_emb``/``features`` through this base."""

    num_items: int
    item_emb: nn.Module
    features: ItemFeatureBag | None

    def _init_item_table(self, num_items: int, d_model: int, item_table: bool,
                         item_features: ItemFeatureMap | None) -> None:
        from grstack.runtime.model.item_rows import ExternalItemRows

        if item_features is not None and item_features.num_items != num_items:
            raise ValueError(f"the item feature map covers {item_features.num_items} items, the model {num_items}")
        self.features = ItemFeatureBag(item_features) if item_features is not None else None
        rows = self.table_rows(num_items, item_features)
        # item_table=False: the rows live elsewhere (training's sharded table); nothing is allocated for them
        self.item_emb = nn.Embedding(rows, d_model) if item_table else ExternalItemRows(rows, d_model)

    @staticmethod
    def table_rows(num_items: int, item_features: ItemFeatureMap | None) -> int:
        """Rows of the item table: padding, the items, then every feature value."""
        return num_items + 1 + (item_features.num_rows if item_features is not None else 0)

    @property
    def keys_per_token(self) -> int:
        """Table rows one item token reads (1 without side features)."""
        return 1 + (self.features.rows.shape[1] if self.features is not None else 0)

    def item_feature_map(self) -> ItemFeatureMap | None:
        return self.features.feature_map() if self.features is not None else None

    def token_keys(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[n, keys_per_token] table rows of item tokens ``item_ids`` (what a sharded lookup fetches)."""
        return self.features.token_keys(item_ids) if self.features is not None else item_ids[:, None]

    def token_rows(self, item_ids: torch.Tensor, looked: torch.Tensor | None = None) -> torch.Tensor:
        """[n, d] input rows of item tokens: the item row plus its pooled features. ``looked``: the rows of
        :meth:`token_keys` already fetched (``[n * keys_per_token, d]`` or ``[n, keys_per_token, d]``);
        None: read from ``item_emb``."""
        from grstack import kernels

        if looked is None:
            if self.features is None:
                return kernels.embedding_gather(self.item_emb.weight, item_ids)
            keys = self.token_keys(item_ids)
            looked = kernels.embedding_gather(self.item_emb.weight, keys.reshape(-1))
        if self.features is None:
            return looked.reshape(item_ids.numel(), -1)
        return self.features.pool(item_ids, looked.reshape(item_ids.numel(), self.keys_per_token, -1))

    def item_table_weight(self) -> torch.Tensor:
        """The item rows (padding and items, no feature rows): what retrieval scores against."""
        return self.item_emb.weight[: self.num_items + 1]

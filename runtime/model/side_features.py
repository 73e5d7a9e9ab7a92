"""Item side features pooled into item tokens, user context tokens and action inputs (docs/features.md).

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

User context (:class:`UserContextLayout`): the values of user fields (age, gender, ...) are table rows after
the item features; each field becomes one contextual token at the head of the user's sequence (the mean of
its values' rows), which every later token can attend to and whose output is not used. Action inputs: a
history token adds the sum of learned vectors of its own action bits (click, like, ...); a candidate adds a
"to be predicted" vector instead, so the ranking head never sees the label it predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from grstack import kernels
from grstack.runtime.model.item_rows import ExternalItemRows


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

    def token_keys(self, item_ids: torch.Tensor) -> torch.Tensor:
        """On ``item_ids``' device (host ids for a sharded lookup stay on the host)."""
        rows = self.rows[item_ids.to(self.rows.device)].to(item_ids.device)
        return torch.cat([item_ids[:, None], rows], dim=1)

    def pool(self, item_ids: torch.Tensor, looked: torch.Tensor) -> torch.Tensor:
        """[n, d] token rows from ``looked`` [n, 1 + W, d], the rows of :meth:`token_keys`."""
        w = self.weights[item_ids.to(self.weights.device)].to(device=looked.device, dtype=looked.dtype)
        return looked[:, 0] + torch.einsum("nw,nwd->nd", w, looked[:, 1:])


@dataclass
class UserContextLayout:
    """Where user-feature values sit in the table: field ``c``'s value ``v`` is row ``base + offset_c + v - 1``."""

    sizes: dict[str, int]
    base: int

    @property
    def num_rows(self) -> int:
        return sum(self.sizes.values())

    @property
    def num_fields(self) -> int:
        return len(self.sizes)

    def keys(self, context: torch.Tensor) -> torch.Tensor:
        """[B, C, W] table rows of value ids ``context`` (0, no value: row 0, weighed 0)."""
        firsts = [self.base]
        for n in list(self.sizes.values())[:-1]:
            firsts.append(firsts[-1] + n)
        first = torch.tensor(firsts, dtype=torch.int64, device=context.device)[None, :, None]
        return torch.where(context > 0, first + context - 1, torch.zeros_like(context))

    @staticmethod
    def weights(context: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, C, W]: 1 / (values of the field the user has) on values, 0 on padding."""
        has = (context > 0).to(dtype)
        return has / has.sum(dim=2, keepdim=True).clamp(min=1)


def batch_keys(item_features: ItemFeatureMap | None, context_layout: UserContextLayout | None,
               item_ids: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
    """Every table row a batch's input reads, flat: each token's item and feature rows (token-major), then
    each sequence's context rows. A pure function of the layouts, so the batch thread computes it on the host
    with the same result as the model's :meth:`ItemTokens.lookup_keys`."""
    keys = item_ids if item_features is None else item_features.token_keys(item_ids).reshape(-1)
    if context_layout is not None:
        if context is None:
            raise ValueError("the model reads user context: the batch has none")
        keys = torch.cat([keys, context_layout.keys(context).reshape(-1)])
    return keys


class ItemTokens(nn.Module):
    """The item table (item rows, then feature-value rows) and what an item token reads of it; HSTU and
    SASRec keep theirs in ``item_emb``/``features`` through this base."""

    num_items: int
    d_model: int
    input_dropout: float
    item_emb: nn.Module
    features: ItemFeatureBag | None
    context: UserContextLayout | None
    action_emb: nn.Embedding | None

    def _init_item_table(self, num_items: int, d_model: int, item_table: bool,
                         item_features: ItemFeatureMap | None, user_features: dict[str, int] | None = None,
                         action_bits: int = 0) -> None:
        if item_features is not None and item_features.num_items != num_items:
            raise ValueError(f"the item feature map covers {item_features.num_items} items, the model {num_items}")
        self.features = ItemFeatureBag(item_features) if item_features is not None else None
        base = num_items + 1 + (item_features.num_rows if item_features is not None else 0)
        self.context = UserContextLayout(dict(user_features), base) if user_features else None
        rows = self.table_rows(num_items, item_features, user_features)
        # item_table=False: the rows live elsewhere (training's sharded table); nothing is allocated for them
        self.item_emb = nn.Embedding(rows, d_model) if item_table else ExternalItemRows(rows, d_model)
        # one vector per action bit, then the candidates' "to be predicted" vector
        self.action_emb = nn.Embedding(action_bits + 1, d_model) if action_bits else None
        if self.action_emb is not None:
            nn.init.trunc_normal_(self.action_emb.weight, std=d_model**-0.5)

    @staticmethod
    def table_rows(num_items: int, item_features: ItemFeatureMap | None,
                   user_features: dict[str, int] | None = None) -> int:
        """Rows of the item table: padding, the items, every item feature value, every user feature value."""
        return (num_items + 1 + (item_features.num_rows if item_features is not None else 0)
                + (sum(user_features.values()) if user_features else 0))

    @property
    def num_context(self) -> int:
        """Contextual tokens at the head of each sequence (one per user field)."""
        return self.context.num_fields if self.context is not None else 0

    def lookup_keys(self, batch: Any) -> torch.Tensor:
        """Every table row ``batch``'s input reads (:func:`batch_keys`), on the batch's device."""
        keys = self.token_keys(batch.item_ids).reshape(-1)
        if self.context is None:
            return keys
        if batch.context is None:
            raise ValueError("the model reads user context: the batch has none")
        return torch.cat([keys, self.context.keys(batch.context).reshape(-1)])

    def looked_rows(self, batch: Any, looked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(token rows [n, d], context rows [B, C, d] or None) from the rows of :meth:`lookup_keys`."""
        n = batch.item_ids.numel() * self.keys_per_token
        ctx = self.context_rows(batch.context, looked[n:]) if self.context is not None else None
        return self.token_rows(batch.item_ids, looked[:n]), ctx

    def context_rows(self, context: torch.Tensor, looked: torch.Tensor | None = None) -> torch.Tensor:
        """[B, C, d] contextual token rows: per field, the mean of the user's value rows (zero without values).
        ``looked``: the rows of the context keys already fetched; None: read from ``item_emb``."""
        assert self.context is not None
        keys = self.context.keys(context)
        if looked is None:
            looked = kernels.embedding_gather(self.item_emb.weight, keys.reshape(-1))
        looked = looked.reshape(*keys.shape, -1)
        w = UserContextLayout.weights(context.to(looked.device), looked.dtype)
        return torch.einsum("bcw,bcwd->bcd", w, looked)

    def action_vectors(self, input_actions: torch.Tensor | None) -> torch.Tensor | None:
        """[n, d] what each token adds for its own actions (candidates: the "to be predicted" vector); None
        when the model takes no action inputs."""
        if self.action_emb is None:
            return None
        if input_actions is None:
            raise ValueError("the model reads action inputs: the batch has none (input_actions)")
        bits = self.action_emb.num_embeddings - 1
        a = input_actions.to(self.action_emb.weight.device)
        on = ((a[:, None] >> torch.arange(bits, device=a.device)[None, :]) & 1) * (a[:, None] >= 0)
        out = on.to(self.action_emb.weight.dtype) @ self.action_emb.weight[:bits]
        return out + (a < 0).to(out.dtype)[:, None] * self.action_emb.weight[bits]

    def with_context(self, x: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                     context_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The jagged input with ``C`` contextual tokens ``context_x`` [B, C, d] at the head of every sequence:
        (x, offsets, timestamps, index of the original tokens). A contextual token carries its sequence's
        first timestamp (it is as old as the history it heads)."""
        B, C = context_x.shape[0], context_x.shape[1]
        n = x.shape[0]
        dev = x.device
        new_offsets = offsets + C * torch.arange(B + 1, device=dev)
        seg = kernels.segment_ids(offsets, n)
        keep = torch.arange(n, device=dev) + C * (seg + 1)
        head = (new_offsets[:-1][:, None] + torch.arange(C, device=dev)[None, :]).reshape(-1)
        out = x.new_empty((n + B * C, x.shape[1]))
        out[keep] = x
        out[head] = context_x.reshape(B * C, -1).to(x.dtype)
        ts = timestamps.new_empty(n + B * C)
        ts[keep] = timestamps
        first = timestamps[offsets[:-1].clamp(max=max(n - 1, 0))] if n else timestamps.new_zeros(B)
        ts[head] = first[:, None].expand(B, C).reshape(-1)
        return out, new_offsets, ts, keep

    @property
    def keys_per_token(self) -> int:
        """Table rows one item token reads (1 without side features)."""
        return 1 + (self.features.rows.shape[1] if self.features is not None else 0)

    def token_keys(self, item_ids: torch.Tensor) -> torch.Tensor:
        """[n, keys_per_token] table rows of item tokens ``item_ids`` (what a sharded lookup fetches)."""
        return self.features.token_keys(item_ids) if self.features is not None else item_ids[:, None]

    def token_rows(self, item_ids: torch.Tensor, looked: torch.Tensor | None = None) -> torch.Tensor:
        """[n, d] input rows of item tokens: the item row plus its pooled features. ``looked``: the rows of
        :meth:`token_keys` already fetched (``[n * keys_per_token, d]`` or ``[n, keys_per_token, d]``);
        None: read from ``item_emb``."""
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

"""``build_model``: the model a config names, with its item count, length and ranking tasks."""

from __future__ import annotations

from torch import nn

from grstack.runtime.model.fuxi import FuXiAlpha
from grstack.runtime.model.hstu import HSTU
from grstack.runtime.model.sasrec import SASRec
from grstack.runtime.model.side_features import ItemFeatureMap
from grstack.runtime.training_config import ModelConfig


def build_model(cfg: ModelConfig, num_items: int, max_len: int, num_tasks: int = 1,
                item_table: bool = True, item_features: ItemFeatureMap | None = None,
                user_features: dict[str, int] | None = None) -> nn.Module:
    """``item_table=False``: a model whose item rows are passed in (training's sharded table); its
    ``item_emb`` holds no weight. Their initial values are :func:`initial_item_rows`. ``item_features``:
    the items' side features (their rows follow the items' in the table); ``user_features``: the user fields'
    value counts when the model reads user context (their rows follow the item features')."""
    kwargs = cfg.model_dump(exclude={"type"})
    kwargs["item_table"] = item_table
    kwargs["item_features"] = item_features
    kwargs["user_features"] = dict(user_features) if user_features else None
    if cfg.type == "hstu":
        kwargs.pop("ffn_mult")
        return HSTU(num_items, max_len=max_len, num_tasks=num_tasks, **kwargs)
    if cfg.type == "fuxi":
        return FuXiAlpha(num_items, max_len=max_len, num_tasks=num_tasks, **kwargs)
    for key in ("dqk", "dv", "time_buckets", "position_bias", "time_bias", "time_bias_query", "ranking_head"):
        kwargs.pop(key)
    return SASRec(num_items, max_len=max_len, num_tasks=num_tasks, **kwargs)

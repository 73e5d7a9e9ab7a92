"""Loading the serving artefact (``RUN/model.pt`` written by training) and making untrained ones.

Untrained artefacts are for latency benchmarks and tests: the relay path's cost and exactness do not
depend on the weights, and a benchmark needs a ``max_len`` that covers its length sweep.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from grstack.runtime.errors import UserError
from grstack.runtime.model import (
    HSTU,
    build_model,
    export_model,
    load_exported_with_vocab,
    resolve_model_file,
    task_names,
)


def load_ranking_model(path: str | Path) -> tuple[HSTU, list[str]]:
    model, tasks, _ = load_serving_model(path)
    return model, tasks


def load_serving_model(path: str | Path) -> tuple[HSTU, list[str], dict[str, list[str]] | None]:
    """The ranking model, its served tasks and its user features' vocabularies (None without user context):
    what a ranker needs (``RankerService(model, tasks, user_vocab=...)``)."""
    p = resolve_model_file(path)
    model, cfg, tasks, vocab = load_exported_with_vocab(p)
    if cfg.model.type not in ("hstu", "fuxi") or not isinstance(model, HSTU) or model.rank_head is None:
        raise UserError(f"{p}: relay serving needs an HSTU or FuXi-α model trained with the ranking head "
                        f"(model.type=hstu or fuxi, model.ranking_head=true); this one is {cfg.model.type}")
    if cfg.model.time_bias_query == "next" and cfg.model.time_bias:
        raise UserError(f"{p}: relay serving needs model.time_bias_query=self; this model was trained with "
                        f"model.time_bias_query=next, whose cached prefixes would not be exact (the last prefix "
                        f"token's keys and values depend on the next event's time)")
    if cfg.data.user_features and vocab is None:
        raise UserError(f"{p}: this model reads user context but its artefact keeps no user-feature vocabularies "
                        f"to map requests with; export it again with this version")
    if cfg.loss.ranking_on == "exposures":  # trained on logged impressions: "next" was never a label
        model.keep_tasks(range(1, len(tasks)))
        tasks = tasks[1:]
    return model, tasks, vocab


def write_untrained_model(path: str | Path, *, num_items: int = 10_000, max_len: int = 512, d_model: int = 64,
                          num_blocks: int = 2, num_heads: int = 2, dqk: int = 32, dv: int = 32,
                          actions: tuple[str, ...] = (), seed: int = 0) -> Path:
    """An exported HSTU (random weights, the same format as training's ``model.pt``)."""
    from grstack.runtime.data import from_sequences
    from grstack.runtime.training_config import Config

    cfg = Config.model_validate({
        "name": "untrained-serving-model",
        "data": {"format": "parquet", "source": "(none)", "max_len": max_len},
        "model": {"type": "hstu", "d_model": d_model, "num_blocks": num_blocks, "num_heads": num_heads,
                  "dqk": dqk, "dv": dv, "dropout": 0.0, "input_dropout": 0.0, "ranking_head": True}})
    acts = [np.zeros(3, dtype=np.int64)] if actions else None
    ds = from_sequences([0], [np.array([1, 2, 3])], [np.array([1, 2, 3])], num_items=num_items, actions=acts,
                        action_names=list(actions))
    torch.manual_seed(seed)
    model = build_model(cfg.model, num_items, max_len, num_tasks=len(task_names(ds)))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    export_model(model, cfg, ds, out)
    return out

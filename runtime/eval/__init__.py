"""Leave-one-out full-ranking evaluation and its metrics (docs/architecture.md §4).

Other packages import from here, never a submodule: ``eval_ranks`` (the target's rank over the whole
catalogue), ``exclude_history``, ``score_items``, ``target_ranks`` and ``metrics_from_ranks``; for the ranking
head, ``rank_head_logits`` / ``evaluate_ranking`` (candidate sets like training's), ``has_trained_rank_head``,
the metrics ``auc``, ``gauc``, ``normalized_entropy`` and ``ranking_report``, and ``format_ranking``. Exports load lazily, so
importing this package (as ``grstack --help`` does, through ``eval.cli``) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.eval.evaluate import eval_ranks, exclude_history, last_token_outputs, score_items
    from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks
    from grstack.runtime.eval.rank_head import evaluate_ranking, has_trained_rank_head, rank_head_logits
    from grstack.runtime.eval.ranking import auc, format_ranking, gauc, normalized_entropy, ranking_report

_EXPORTS = {
    "eval_ranks": "grstack.runtime.eval.evaluate",
    "exclude_history": "grstack.runtime.eval.evaluate",
    "last_token_outputs": "grstack.runtime.eval.evaluate",
    "score_items": "grstack.runtime.eval.evaluate",
    "metrics_from_ranks": "grstack.runtime.eval.metrics",
    "target_ranks": "grstack.runtime.eval.metrics",
    "evaluate_ranking": "grstack.runtime.eval.rank_head",
    "has_trained_rank_head": "grstack.runtime.eval.rank_head",
    "rank_head_logits": "grstack.runtime.eval.rank_head",
    "auc": "grstack.runtime.eval.ranking",
    "gauc": "grstack.runtime.eval.ranking",
    "format_ranking": "grstack.runtime.eval.ranking",
    "normalized_entropy": "grstack.runtime.eval.ranking",
    "ranking_report": "grstack.runtime.eval.ranking",
}

__all__ = ["auc", "eval_ranks", "evaluate_ranking", "exclude_history", "format_ranking", "gauc", "has_trained_rank_head",
           "last_token_outputs", "metrics_from_ranks", "normalized_entropy", "rank_head_logits", "ranking_report",
           "score_items", "target_ranks"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

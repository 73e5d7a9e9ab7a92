"""Leave-one-out full-ranking evaluation and its metrics (docs/architecture.md §4).

Other packages import from here, never a submodule: ``eval_ranks`` (the target's rank over the whole
catalogue), ``exclude_history``, ``score_items``, ``target_ranks`` and ``metrics_from_ranks``. Exports load lazily, so
importing this package (as ``grstack --help`` does, through ``eval.cli``) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grstack.runtime.eval.evaluate import eval_ranks, exclude_history, last_token_outputs, score_items
    from grstack.runtime.eval.metrics import metrics_from_ranks, target_ranks

_EXPORTS = {
    "eval_ranks": "grstack.runtime.eval.evaluate",
    "exclude_history": "grstack.runtime.eval.evaluate",
    "last_token_outputs": "grstack.runtime.eval.evaluate",
    "score_items": "grstack.runtime.eval.evaluate",
    "metrics_from_ranks": "grstack.runtime.eval.metrics",
    "target_ranks": "grstack.runtime.eval.metrics",
}

__all__ = ["eval_ranks", "exclude_history", "last_token_outputs", "metrics_from_ranks", "score_items",
           "target_ranks"]


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The text of ``grstack demo``'s report: each figure with what it measures and what chance would score, so
a reader can tell a model that learned from one that did not without reading the docs.

Pure functions of the run's summary and the popularity baseline (the serving leg's lines: serve/demo.py).
"""

from __future__ import annotations

import textwrap
from typing import Any

# An AUC within this of 0.5 is reported as "about chance": the demo's candidate sets are a few thousand
# impressions, whose AUC moves by a few hundredths from seed to seed.
CHANCE_MARGIN = 0.05
EVAL_DOCS = "docs/training.md, section 7a"
WIDTH = 110


def auc_verdict(auc: float | None) -> str:
    if auc is None:
        return "undefined"
    if auc >= 0.5 + CHANCE_MARGIN:
        return "above chance"
    if auc <= 0.5 - CHANCE_MARGIN:
        return "below chance"
    return "about chance"


def _num(value: Any, fmt: str = ".2f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "n/a"


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def retrieval_lines(summary: dict[str, Any], popularity: dict[str, float]) -> list[str]:
    """Test hr@10 and ndcg@10 against a random ranking and the most-popular-items ranking."""
    test, items = summary["metrics"]["test"], int(summary["num_items"])
    random_hr = min(1.0, 10 / max(items, 1))
    ratio = test["ndcg@10"] / max(popularity["ndcg@10"], 1e-9)
    return _wrap(
        f"retrieval (test, {summary['num_users']} users, all {items} items ranked): the held-out next item is "
        f"in the top 10 for {test['hr@10']:.1%} of users (hr@10; a random ranking: about {random_hr:.1%}, the "
        f"most popular items: {popularity['hr@10']:.1%}); ndcg@10 {test['ndcg@10']:.4f}, which also rewards a "
        f"high place in the top 10, is {ratio:.1f}x the popularity baseline's {popularity['ndcg@10']:.4f}")


def ranking_lines(ranking: dict[str, Any] | None, candidates: int) -> list[str]:
    """The ranking head's test block: AUC, GAUC and NE per task with chance, and exposure AUC."""
    if not ranking:
        return []
    if "skipped" in ranking:
        return [f"ranking head: not evaluated ({ranking['skipped']})"]
    actions = [t for t in ranking if t != "next"]
    lines = _wrap(
        f"ranking head (test): each user's held-out next item among {candidates} candidates, the other "
        f"{candidates - 1} random items; next: is it the held-out item"
        + (f"; {'/'.join(actions)}: did the user do that to it" if actions else "")
        + ". AUC: how often a positive outscores a negative (chance 0.50); GAUC: the same within each user; "
        "NE: log loss over that of always predicting the positive rate (1.00 = no better, lower is better)")
    learned = True
    for task, r in ranking.items():
        verdict = auc_verdict(r.get("auc"))
        learned &= verdict == "above chance"
        lines.append(f"  {task:<10} AUC {_num(r.get('auc'))}  GAUC {_num(r.get('gauc'))}  NE {_num(r.get('ne'))}  "
                     f"{verdict} ({r.get('positives', 0)} positives in {r.get('impressions', 0)} impressions)")
    exposure = {t: r["exposure_auc"] for t, r in ranking.items() if "exposure_auc" in r}
    if exposure:
        hint = ("; telling which shown items a user acts on is what loss.ranking_on=exposures trains for"
                if any(auc_verdict(v) != "above chance" for v in exposure.values()) else "")
        lines += _wrap("  exposure AUC (across users, the item actually shown next only: did the user act on it; "
                       "chance 0.50): " + ", ".join(f"{t} {_num(v)} ({auc_verdict(v)})" for t, v in exposure.items())
                       + hint)
    if not learned:
        lines += _wrap("  a task about or below chance is one the head has not learned from the demo's data (few "
                       f"positives, or too little training: more epochs or loss.ranking_weight; {EVAL_DOCS})")
    return lines

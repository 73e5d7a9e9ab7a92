"""The demo's report states each figure with its meaning and chance's, and says when the head did not learn."""

from __future__ import annotations

import pytest

from grstack.runtime.demo_report import auc_verdict, ranking_lines, retrieval_lines
from grstack.runtime.serve.demo import CANDIDATES, report_lines

pytestmark = pytest.mark.unit


def _task(auc: float | None, exposure: float | None = None) -> dict[str, object]:
    r: dict[str, object] = {"auc": auc, "gauc": auc, "ne": 0.9, "impressions": 3200, "positives": 400}
    if exposure is not None:
        r["exposure_auc"] = exposure
    return r


def _text(lines: list[str]) -> str:
    """The lines as one paragraph (the report wraps at 110 columns)."""
    return " ".join(line.strip() for line in lines)


@pytest.mark.parametrize(("auc", "verdict"), [(0.75, "above chance"), (0.55, "above chance"),
                                              (0.53, "about chance"), (0.47, "about chance"),
                                              (0.38, "below chance"), (None, "undefined")])
def test_auc_verdicts_are_read_against_chance(auc: float | None, verdict: str) -> None:
    assert auc_verdict(auc) == verdict


def test_a_trained_head_is_reported_above_chance_with_what_the_figures_mean() -> None:
    text = _text(ranking_lines({"next": _task(0.75), "click": _task(0.7, exposure=0.51)}, 8))
    assert "among 8 candidates, the other 7 random items" in text and "chance 0.50" in text
    assert "1.00 = no better" in text  # what NE compares with
    assert "next       AUC 0.75" in text and "click      AUC 0.70" in text
    assert "click 0.51 (about chance)" in text
    assert "not learned" not in text


def test_an_untrained_head_is_reported_below_chance_with_the_reason_and_where_to_read() -> None:
    text = _text(ranking_lines({"next": _task(0.39), "like": _task(None)}, 8))
    assert "AUC 0.39  GAUC 0.39  NE 0.90  below chance" in text and "AUC n/a" in text
    assert "has not learned" in text and "docs/training.md" in text


def test_a_skipped_or_absent_ranking_block() -> None:
    assert ranking_lines(None, 8) == []
    assert ranking_lines({"skipped": "loss.ranking_weight is 0"}, 8) == [
        "ranking head: not evaluated (loss.ranking_weight is 0)"]


def test_retrieval_is_read_against_a_random_ranking_and_popularity() -> None:
    summary = {"num_users": 400, "num_items": 800, "metrics": {"test": {"hr@10": 0.78, "ndcg@10": 0.6}}}
    text = _text(retrieval_lines(summary, {"hr@10": 0.19, "ndcg@10": 0.12}))
    assert "top 10 for 78.0% of users" in text and "a random ranking: about 1.2%" in text
    assert "most popular items: 19.0%" in text and "5.0x the popularity baseline's 0.1200" in text


@pytest.mark.parametrize(("diff", "same"), [(3e-8, True), (0.2, False)])
def test_the_serving_lines_give_the_top1_rate_next_to_chance(diff: float, same: bool) -> None:
    report = {"replicas": 2, "url": "http://127.0.0.1:1", "ok": 200, "requests": 200, "errors": 0, "p50_ms": 7.0,
              "p99_ms": 25.0, "cache": {"device": 199, "dram": 0, "miss": 1}, "hit_rate": 0.995,
              "prefills_admitted": 200, "hr@1": 0.2, "max_abs_score_diff": diff}
    lines = report_lines(report)
    assert f"ranked first among {CANDIDATES} candidates for 20% of requests (chance 5%)" in lines[2]
    assert ("the same scores, to float rounding" in lines[2]) is same

"""Ranking-quality metrics of binary labels against scores: AUC, GAUC and normalised entropy (pure numpy).

Each function returns a :class:`Score`: the value, or ``None`` with the reason when the metric is undefined
on the data (one class only), so a summary says why a number is missing instead of showing a NaN.

* AUC is the Mann-Whitney statistic from tied average ranks: the share of (positive, negative) pairs the
  positive wins, ties counted half. Ranks are kept doubled, as integers, so the pair count is exact.
* GAUC is the per-group AUC averaged with each group's impression count as its weight; groups with one
  class only have no AUC and are skipped (and counted).
* Exposure AUC (action tasks only): the AUC, across users, of each user's *logged* exposure (the held-out
  event, candidate slot 0) against its real label: does the head know whether the user clicked (liked,
  watched long) the item actually shown next. Uniform negatives carry label 0 for every task, so per-user
  AUC and GAUC of an action task mostly measure telling the real next item from random ones; this one
  isolates the action.
* NE (He et al. 2014, "Practical lessons from predicting clicks on ads at Facebook") is the mean log loss
  divided by the entropy of the empirical positive rate: 1.0 is a model that predicts only that rate, lower
  is better. It reads logits, so the log loss is computed stably (``softplus(z) - y·z``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Score(NamedTuple):
    value: float | None
    reason: str | None = None


class GroupScore(NamedTuple):
    value: float | None
    groups: int  # groups with both classes (the ones averaged)
    skipped: int  # groups with one class only
    reason: str | None = None


def _check(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels ({y.size}) and scores ({s.size}) differ in length")
    if not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0 or 1")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN")
    return y.astype(np.int64), s


def _one_class(positives: int, total: int) -> str | None:
    if total == 0:
        return "no impressions"
    if positives == 0:
        return "no positives"
    if positives == total:
        return "no negatives"
    return None


def _doubled_ranks(groups: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Twice the 1-based average rank of each score within its group (ties share the mean rank): an integer."""
    n = scores.size
    order = np.lexsort((scores, groups))
    g, s = groups[order], scores[order]
    new_group = np.ones(n, dtype=bool)
    new_group[1:] = g[1:] != g[:-1]
    new_run = new_group.copy()
    new_run[1:] |= s[1:] != s[:-1]
    run_start = np.flatnonzero(new_run)
    run_end = np.append(run_start[1:], n)  # exclusive
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(n), 0))
    # ranks run_start+1 .. run_end within the whole array; their mean, doubled, is run_start + run_end + 1
    doubled = np.repeat(run_start + run_end + 1, run_end - run_start) - 2 * group_start
    out = np.empty(n, dtype=np.int64)
    out[order] = doubled
    return out


def _auc_parts(y: np.ndarray, s: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray]:
    """Per group (0..G-1): twice the positives' winning pair count, positives, negatives, impressions."""
    _, gid = np.unique(groups, return_inverse=True)
    gid = gid.reshape(-1)
    r2 = _doubled_ranks(gid, s)
    G = int(gid.max()) + 1 if gid.size else 0
    n = np.bincount(gid, minlength=G).astype(np.int64)
    pos = np.bincount(gid, weights=y, minlength=G).astype(np.int64)
    rank_sum2 = np.zeros(G, dtype=np.int64)
    np.add.at(rank_sum2, gid[y == 1], r2[y == 1])
    wins2 = rank_sum2 - pos * (pos + 1)  # subtract the positives' own ranks among themselves (doubled)
    return wins2, pos, n - pos, n


def auc(labels: np.ndarray, scores: np.ndarray) -> Score:
    """Probability that a random positive scores above a random negative (ties half); exact."""
    y, s = _check(labels, scores)
    reason = _one_class(int(y.sum()), y.size)
    if reason is not None:
        return Score(None, reason)
    wins2, pos, neg, _ = _auc_parts(y, s, np.zeros(y.size, dtype=np.int64))
    return Score(float(wins2[0] / (2 * pos[0] * neg[0])))


def gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> GroupScore:
    """Impression-weighted mean of per-group AUC over the groups (users) that have both classes."""
    y, s = _check(labels, scores)
    g = np.asarray(groups).reshape(-1)
    if g.shape != y.shape:
        raise ValueError(f"groups ({g.size}) and labels ({y.size}) differ in length")
    if y.size == 0:
        return GroupScore(None, 0, 0, "no impressions")
    wins2, pos, neg, n = _auc_parts(y, s, g)
    ok = (pos > 0) & (neg > 0)
    skipped = int((~ok).sum())
    if not ok.any():
        return GroupScore(None, 0, skipped, "no group has both positives and negatives")
    per_group = wins2[ok] / (2.0 * pos[ok] * neg[ok])
    return GroupScore(float(np.sum(per_group * n[ok]) / n[ok].sum()), int(ok.sum()), skipped)


def normalized_entropy(labels: np.ndarray, logits: np.ndarray) -> Score:
    """Mean log loss of ``sigmoid(logits)`` over the entropy of the empirical positive rate (He et al. 2014)."""
    y, z = _check(labels, logits)
    reason = _one_class(int(y.sum()), y.size)
    if reason is not None:
        return Score(None, reason)
    log_loss = float(np.mean(np.logaddexp(0.0, z) - y * z))
    p = float(y.mean())
    background = -(p * np.log(p) + (1.0 - p) * np.log(1.0 - p))
    return Score(log_loss / background)


def task_report(labels: np.ndarray, logits: np.ndarray, groups: np.ndarray) -> dict[str, object]:
    """One task's summary block: ``auc``, ``gauc``, ``ne``, ``impressions``, ``positives``, the groups GAUC
    averaged and skipped, and ``undefined`` (metric -> why it is None)."""
    y = np.asarray(labels).reshape(-1)
    a, ne = auc(y, logits), normalized_entropy(y, logits)
    g = gauc(y, logits, groups)
    undefined = {k: r for k, r in (("auc", a.reason), ("gauc", g.reason), ("ne", ne.reason)) if r is not None}
    return {"auc": a.value, "gauc": g.value, "ne": ne.value, "impressions": int(y.size),
            "positives": int(y.sum()), "gauc_users": g.groups, "gauc_users_skipped": g.skipped,
            "undefined": undefined}


def ranking_report(labels: np.ndarray, logits: np.ndarray, tasks: list[str],
                   ranking_on: str = "uniform") -> dict[str, dict[str, object]]:
    """Per task name, :func:`task_report` of candidate sets ``labels`` / ``logits`` [U, M, T] (one set per
    user, so the user's row is the GAUC group). ``uniform``: candidate 0 is the user's logged next event, the
    others uniform items, and the action tasks (t >= 1) also get ``exposure_auc`` (module doc).
    ``exposures``: every candidate is a logged exposure with its own labels; task 0 (every one was shown) is
    left out."""
    labels, logits = np.asarray(labels), np.asarray(logits)
    if labels.shape != logits.shape or labels.ndim != 3 or labels.shape[2] != len(tasks):
        raise ValueError(f"labels {labels.shape} and logits {logits.shape} must both be [users, candidates, "
                         f"{len(tasks)} tasks]")
    U, M, _ = labels.shape
    users = np.repeat(np.arange(U), M)
    if ranking_on == "exposures":
        return {name: task_report(labels[:, :, t].reshape(-1), logits[:, :, t].reshape(-1), users)
                for t, name in enumerate(tasks) if t >= 1}
    if ranking_on != "uniform":
        raise ValueError(f"ranking_on must be uniform or exposures, got {ranking_on!r}")
    out = {name: task_report(labels[:, :, t].reshape(-1), logits[:, :, t].reshape(-1), users)
           for t, name in enumerate(tasks)}
    for t, name in enumerate(tasks[1:], start=1):
        exposed = auc(labels[:, 0, t], logits[:, 0, t])
        out[name]["exposure_auc"] = exposed.value
        if exposed.reason is not None:
            out[name]["undefined"]["exposure_auc"] = exposed.reason  # type: ignore[index]
    return out


def format_ranking(split: str, ranking: dict[str, dict[str, object]]) -> list[str]:
    """Text lines of a summary's ``ranking`` block (one per task, or why it was skipped)."""
    if "skipped" in ranking:
        return [f"{split:5s} ranking skipped: {ranking['skipped']}"]
    lines = []
    for task, r in ranking.items():
        keys = ("auc", "gauc", "ne", *(("exposure_auc",) if "exposure_auc" in r else ()))
        vals = " ".join(f"{k}={r[k]:.4f}" if isinstance(r[k], float) else f"{k}=n/a" for k in keys)
        lines.append(f"{split:5s} ranking {task}: {vals} impressions={r['impressions']} positives={r['positives']}")
    return lines

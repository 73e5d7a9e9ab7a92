"""Summary statistics of a dataset: sizes, length distribution, popularity skew, time span, action rates and
side features."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np

from grstack.runtime.data.dataset import SequenceDataset
from grstack.runtime.data.features import Features, coverage


def zipf_exponent(counts: np.ndarray) -> float:
    """Slope of log(count) against log(rank), fitted on log-spaced ranks so the long tail of rare items
    does not outweigh the head. Items never seen are left out."""
    c = np.sort(counts[counts > 0])[::-1].astype(np.float64)
    if len(c) < 3:
        return float("nan")
    ranks = np.unique(np.geomspace(1, len(c), num=min(len(c), 64)).astype(np.int64))
    x, y = np.log(ranks), np.log(c[ranks - 1])
    slope = np.polyfit(x, y, 1)[0]
    return float(-slope)


def gini(counts: np.ndarray) -> float:
    """0 when every item is equally popular, towards 1 when a few items take every event."""
    c = np.sort(counts.astype(np.float64))
    n, total = len(c), c.sum()
    if n == 0 or total == 0:
        return float("nan")
    return float((2.0 * np.arange(1, n + 1) - n - 1).dot(c) / (n * total))


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_CALENDAR = (-62_135_596_800, 253_402_300_800)  # 0001-01-01 .. 10000-01-01 in Unix seconds


def _iso(ts: int) -> str:
    """UTC date of a stored timestamp (seconds). Pure arithmetic, never the C library's gmtime (which fails
    with EOVERFLOW on some values); a time no calendar date fits (a dataset written before importers
    checked units) is shown as such instead of raising."""
    if not _CALENDAR[0] <= ts < _CALENDAR[1]:
        return f"{ts} s (outside years 1-9999: not Unix seconds?)"
    return (_EPOCH + dt.timedelta(seconds=int(ts))).strftime("%Y-%m-%dT%H:%M:%SZ")


def feature_stats(feats: Features) -> dict[str, dict]:
    """Per field: distinct values, share of rows with a value, mean values per row (over every row)."""
    cov = coverage(feats)
    return {f.name: {"values": f.num_values, "coverage": cov[f.name],
                     "mean_per_row": float(f.offsets[-1] / feats.num_rows) if feats.num_rows else 0.0}
            for f in feats.fields}


def dataset_stats(ds: SequenceDataset) -> dict:
    """Pure function of the dataset; every number is a plain int/float/str so the result is JSON-ready."""
    lengths = ds.lengths
    counts = np.bincount(ds.item_ids, minlength=ds.num_items + 1)[1:]
    by_pop = np.sort(counts)[::-1]
    total = max(int(by_pop.sum()), 1)

    def top_share(frac: float) -> float:
        return float(by_pop[: max(1, math.ceil(frac * ds.num_items))].sum() / total)

    inside = np.ones(max(ds.num_events - 1, 0), dtype=bool)
    starts = ds.offsets[1:-1]
    inside[starts[(starts > 0) & (starts < ds.num_events)] - 1] = False
    gaps = np.diff(ds.timestamps)[inside]
    t0, t1 = int(ds.timestamps.min()), int(ds.timestamps.max())
    out: dict = {
        "name": ds.name,
        "source": ds.source,
        "users": ds.num_users,
        "items": ds.num_items,
        "items_seen": int((counts > 0).sum()),
        "events": ds.num_events,
        "density": ds.num_events / (ds.num_users * ds.num_items),
        "length": {
            "min": int(lengths.min()),
            "mean": float(lengths.mean()),
            "p50": float(np.percentile(lengths, 50)),
            "p90": float(np.percentile(lengths, 90)),
            "p99": float(np.percentile(lengths, 99)),
            "max": int(lengths.max()),
        },
        "popularity": {
            "top1pct_share": top_share(0.01),
            "top10pct_share": top_share(0.10),
            "zipf_exponent": zipf_exponent(counts),
            "gini": gini(counts),
            "max_item_events": int(by_pop[0]),
        },
        "time": {
            "first": t0,
            "last": t1,
            "first_iso": _iso(t0),
            "last_iso": _iso(t1),
            "span_days": (t1 - t0) / 86_400,
            "gap_p50_s": float(np.percentile(gaps, 50)) if len(gaps) else 0.0,
            "gap_p90_s": float(np.percentile(gaps, 90)) if len(gaps) else 0.0,
        },
        "actions": {},
        "filter": {},
        "features": {f.kind: feature_stats(f) for f in (ds.item_features, ds.user_features) if f is not None},
    }
    if ds.actions is not None:
        out["actions"] = {name: float(((ds.actions >> bit) & 1).mean())
                          for bit, name in enumerate(ds.action_names)}
    if "timestamps" in ds.info:
        out["time"]["note"] = str(ds.info["timestamps"])
    if "min_len" in ds.info:
        out["filter"] = {"min_len": ds.info["min_len"], "dropped_users": ds.info.get("dropped_users", 0),
                         "dropped_events": ds.info.get("dropped_events", 0)}
    return out


def format_stats(s: dict) -> str:
    """The human-readable form printed by ``grstack data stats``."""
    ln, pop, tm = s["length"], s["popularity"], s["time"]
    lines = [
        f"dataset     {s['name']}  ({s['source']})",
        f"size        {s['users']} users, {s['items']} items ({s['items_seen']} seen), {s['events']} events, "
        f"density {s['density']:.2e}",
        f"length      min {ln['min']}  mean {ln['mean']:.1f}  p50 {ln['p50']:g}  p90 {ln['p90']:g}  "
        f"p99 {ln['p99']:g}  max {ln['max']}",
        f"popularity  top-1% items {pop['top1pct_share']:.1%} of events, "
        f"top-10% {pop['top10pct_share']:.1%}, "
        f"zipf exponent {pop['zipf_exponent']:.2f}, gini {pop['gini']:.2f}",
        f"time        {tm['first_iso']} .. {tm['last_iso']} ({tm['span_days']:.1f} days), "
        f"gap p50 {tm['gap_p50_s']:g} s, p90 {tm['gap_p90_s']:g} s"
        + (f"; {tm['note']}" if "note" in tm else ""),
    ]
    if s["actions"]:
        lines.append("actions     " + "  ".join(f"{k} {v:.3f}" for k, v in s["actions"].items()))
    if s["filter"]:
        f = s["filter"]
        lines.append(f"filter      kept users with >= {f['min_len']} events "
                     f"(dropped {f['dropped_users']} users, {f['dropped_events']} events)")
    for kind, fields in s.get("features", {}).items():
        for i, (name, f) in enumerate(fields.items()):
            head = f"{kind} feats".ljust(12) if i == 0 else " " * 12
            lines.append(f"{head}{name}: {f['values']} values, {f['coverage']:.1%} of {kind}s covered, "
                         f"{f['mean_per_row']:.2f} per {kind}")
    return "\n".join(lines)

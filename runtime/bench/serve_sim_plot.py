"""The picture of a ``grstack bench serve --simulate`` run: what a reader checks first, in one PNG.

Left, the validation: each held-out real point's measured P99 spread (the repeats' min to max) with the
simulator's prediction on it; middle and right, every mode's simulated P99 against the median length and
against QPS at paper scale, with the bootstrap 95 % interval of each point and the SLO line (a validation-only
run: the left panel alone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grstack.runtime.bench.serve import PLOT_STYLES, capped_ms


def plot_simulation(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result.get("modes") or {}
    # a validation-only run has no paper-scale points: its one panel alone
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8)) if modes else plt.subplots(1, 1, figsize=(7, 4.8),
                                                                                    squeeze=False)
    axes = list(axes.flat)
    val = result.get("validation") or []
    ax = axes[0]
    for k, e in enumerate(val):
        lo, hi = e["p99_ms_measured_spread"]
        ax.plot([k, k], [capped_ms(lo), capped_ms(hi)], "-", color="gray", linewidth=6, alpha=0.5)
        ax.plot(k, capped_ms(e["p99_ms_predicted"]), "o" if e["within"] else "x",
                color="tab:green" if e["within"] else "tab:red", markersize=8)
    ax.set_xticks(range(len(val)), [f"{e['mode']}\n{e['point']}" for e in val], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("P99 rank latency (ms; failures at 1e4)")
    ax.set_title("validation: measured spread (bar), predicted (o within, x outside)", fontsize=9)
    slo = (result.get("scale") or {}).get("slo_ms")
    for (mode, res), style in zip(modes.items(), PLOT_STYLES, strict=False):
        for ax, sweep in ((axes[1], "length"), (axes[2], "qps")):
            pts = sorted((p for p in res["points"] if p["sweep"] == sweep), key=lambda p: p[sweep])
            xs = [p[sweep] for p in pts]
            ys = [capped_ms(p["p99_ms"]) for p in pts]
            lo = [max(1e-3, y - capped_ms(p.get("p99_ms_lo"))) for y, p in zip(ys, pts, strict=True)]
            hi = [max(0.0, capped_ms(p.get("p99_ms_hi")) - y) for y, p in zip(ys, pts, strict=True)]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style, label=mode, capsize=2, markersize=4, linewidth=1)
    if not modes:
        return _save(fig, path)
    for ax, xlabel in ((axes[1], "median long-term length (events)"), (axes[2], "offered load (QPS)")):
        if slo is not None:
            ax.axhline(slo, color="gray", linestyle=":", label=f"SLO {slo:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7)
    axes[1].set_title("simulated at paper scale: P99 vs length", fontsize=9)
    axes[2].set_title("simulated at paper scale: P99 vs QPS", fontsize=9)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

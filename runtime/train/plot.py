"""Training-curve PNG from metrics.jsonl: loss per step and validation metrics per epoch."""

from __future__ import annotations

import json
from pathlib import Path


def plot_training_curves(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        marker = "o" if len(train) < 30 else None
        ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, marker=marker, label="loss")
        if train[0].get("ranking_loss") is not None:
            ax1.plot([r["step"] for r in train], [r["retrieval_loss"] for r in train], lw=1, alpha=0.7, marker=marker,
                     label="retrieval (sampled softmax)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    selected = [k for k in (evals[0] if evals else {}) if k.startswith("ranking.")]  # a ranking select_metric
    for key in ("ndcg@10", "hr@10", *selected):
        if evals and key in evals[0]:
            ax2.plot([r["epoch"] for r in evals], [r[key] for r in evals], marker="o", label=f"valid {key}")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("validation metric")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path

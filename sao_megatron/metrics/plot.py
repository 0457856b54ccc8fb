"""curves.png from metrics.jsonl: reward, value loss and clip fractions over steps."""
from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    ("reward", ["rollout/raw_reward"]),
    ("value loss", ["critic/vf_loss"]),
    ("clip / masked fractions", ["train/pg_clipfrac", "train/pg_clipfrac_low", "train/pg_clipfrac_high"]),
    ("entropy", ["train/entropy"]),
]


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def plot_curves(metrics_path: Path, out_path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.2))
    for ax, (label, keys) in zip(axes, PANELS):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=key.split("/")[-1], linewidth=1.2)
        ax.set_title(label)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return Path(out_path)

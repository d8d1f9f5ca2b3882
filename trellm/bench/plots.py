"""PNG plots of benchmark results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def plot_latency(rows: list[dict], title: str, path: str | Path) -> None:
    """Grouped bars: single-stream decode, aggregate decode and prefill tok/s per engine row.
    Each row: {"label": str, "decode_tok_s", "aggregate_decode_tok_s", "prefill_tok_s"}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("decode_tok_s", "decode tok/s\n(1 stream, TTFT excluded)"),
               ("aggregate_decode_tok_s", "aggregate decode tok/s\n(8 concurrent)"),
               ("prefill_tok_s", "prefill tok/s\n(512-token prompt)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4.2))
    colors = ["#2b6cb0", "#63b3ed", "#c05621", "#f6ad55", "#2f855a", "#9ae6b4"]
    for ax, (key, label) in zip(axes, metrics):
        vals = [r[key] for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=colors[: len(rows)])
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

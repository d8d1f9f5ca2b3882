"""PNG plots of benchmark results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def plot_latency(rows: list[dict], title: str, path: str | Path, spec: dict | None = None) -> None:
    """Grouped bars: single-stream decode, aggregate decode and prefill tok/s per engine row.
    Each row: {"label": str, "decode_tok_s", "aggregate_decode_tok_s", "prefill_tok_s"};
    ``spec``: the bench's {"concurrency", "prefill_len"} for the axis titles."""
    spec = spec or {}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("decode_tok_s", "decode tok/s\n(1 stream, TTFT excluded)"),
               ("aggregate_decode_tok_s", f"aggregate decode tok/s\n({spec.get('concurrency', '?')} concurrent)"),
               ("prefill_tok_s", f"prefill tok/s\n({spec.get('prefill_len', '?')}-token prompt)")]
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


def plot_decode_vs_context(ladder: dict[str, dict], title: str, path: str | Path,
                           roofline: dict[str, float] | None = None) -> None:
    """Decode tok/s (first token excluded) against context length, log-scaled x.
    ``ladder``: {context tokens (str or int): {"decode_tok_s": float, ...}};
    ``roofline``: optional {context: tok/s} drawn dashed beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = sorted(int(k) for k in ladder)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ctx, [ladder[str(c)]["decode_tok_s"] for c in ctx], "o-", color="#2b6cb0", label="trellm")
    for c in ctx:
        ax.annotate(f"{ladder[str(c)]['decode_tok_s']:.0f}", (c, ladder[str(c)]["decode_tok_s"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if roofline:
        rc = sorted(int(k) for k in roofline)
        ax.plot(rc, [roofline[str(c)] for c in rc], "--", color="#718096", label="bandwidth roofline")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctx, [f"{c // 1024}k" if c >= 1024 else str(c) for c in ctx])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s, 1 stream")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

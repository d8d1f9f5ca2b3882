"""PNG plots of a `trellm bench serve` sweep (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def _value(summary: dict | None, key: str) -> float:
    # A level where every request failed has no summary; NaN leaves a gap in the line.
    return float("nan") if summary is None else summary[key]


def log2_count_axis(ax, counts: Sequence[int], xlabel: str = "concurrent requests") -> None:
    """A log2 x axis ticked at the counts swept, y from 0, and the legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel(xlabel)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)


def plot_serve_sweep(levels: Sequence[dict], title: str, path: str | Path) -> None:
    """Two panels against concurrency (log2 x): per-stream and aggregate output tok/s;
    TTFT p50 and p99. ``levels``: the "levels" list of the JSON results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [lv["concurrency"] for lv in levels]
    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(10, 4))
    stream = [_value(lv["stream_decode_tok_s"], "mean") for lv in levels]
    agg = [lv["aggregate_output_tok_s"] for lv in levels]
    tok_ax.plot(conc, agg, "o-", color="#2b6cb0", label="aggregate output tok/s")
    tok_ax.plot(conc, stream, "s-", color="#c05621", label="tok/s per stream (mean, first token excluded)")
    for x, y in zip(conc, agg):
        tok_ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    tok_ax.set_ylabel("output tokens / s")
    tok_ax.set_title("throughput", fontsize=10)
    ttft_ax.plot(conc, [_value(lv["ttft_ms"], "p50") for lv in levels], "o-", color="#2f855a", label="TTFT p50")
    ttft_ax.plot(conc, [_value(lv["ttft_ms"], "p99") for lv in levels], "o--", color="#9ae6b4", label="TTFT p99")
    ttft_ax.set_ylabel("ms")
    ttft_ax.set_title("time to first token", fontsize=10)
    for ax in (tok_ax, ttft_ax):
        log2_count_axis(ax, conc)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve_compare(runs: dict[str, Sequence[dict]], title: str, path: str | Path) -> None:
    """Several servers' sweeps on shared axes: aggregate output tok/s, tok/s per stream
    and TTFT p50 against concurrency. ``runs``: label -> the "levels" list of a result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("aggregate output tok/s", lambda lv: lv["aggregate_output_tok_s"]),
              ("tok/s per stream (mean, first token excluded)", lambda lv: _value(lv["stream_decode_tok_s"], "mean")),
              ("TTFT p50 (ms)", lambda lv: _value(lv["ttft_ms"], "p50")))
    conc = sorted({lv["concurrency"] for levels in runs.values() for lv in levels})
    for ax, (name, get) in zip(axes, panels):
        for label, levels in runs.items():
            ax.plot([lv["concurrency"] for lv in levels], [get(lv) for lv in levels], "o-", label=label)
        ax.set_title(name, fontsize=10)
        log2_count_axis(ax, conc)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

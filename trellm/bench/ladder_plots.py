"""PNG plots of a ``bench ladder`` result (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

HIT, MISS = "#2f855a", "#c53030"


def plot_ladder(result: dict, path: str | Path) -> None:
    """Two panels against context (log2 x): TTFT cold and with the prefix cached,
    and decode tok/s. Each cell is one marker (a filled circle where the needle was
    found, a red cross where it was missed); lines join the per-context means."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cells, means = result["cells"], result["by_context"]
    ctx = sorted(int(k) for k in means)
    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, color in (("cold_ttft_ms", "cold TTFT", "#2b6cb0"), ("hit_ttft_ms", "prefix-hit TTFT", "#dd6b20")):
        ax_t.plot(ctx, [means[str(c)][key] for c in ctx], "-", color=color, label=label)
        _cells(ax_t, cells, key, color)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax_t.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax_t.set_ylabel("time to first token (ms, log)")
    dec = [c for c in ctx if means[str(c)]["decode_tok_s"] is not None]
    ax_d.plot(dec, [means[str(c)]["decode_tok_s"] for c in dec], "-", color="#2b6cb0", label="decode tok/s")
    _cells(ax_d, cells, "decode_tok_s", "#2b6cb0")
    ax_d.set_ylabel("decode tok/s, 1 stream (first token excluded)")
    ax_d.set_ylim(bottom=0)
    for ax in (ax_t, ax_d):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [f"{c / 1024:g}k" if c >= 1024 else str(c) for c in ctx])
        ax.set_xlabel("context (prompt tokens)")
        ax.plot([], [], "o", color="#4a5568", label="needle found")
        ax.plot([], [], "x", color=MISS, label="needle missed")
        ax.legend(fontsize=8)
    hits = f"needle {result['needle_hits']}/{result['needle_cells']}"
    fig.suptitle(f"{result['served_model']}: context ladder ({hits}; depths "
                 f"{', '.join(str(d) for d in result['spec']['depths'])})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cells(ax, cells: list[dict], key: str, color: str) -> None:
    for c in cells:
        if c[key] is None:
            continue
        if c["needle_found"]:
            ax.plot(c["context"], c[key], "o", color=color, markersize=5, alpha=0.8)
        else:
            ax.plot(c["context"], c[key], "x", color=MISS, markersize=8, markeredgewidth=2)

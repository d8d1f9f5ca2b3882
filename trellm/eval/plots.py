"""The quality panel's PNG: KL divergence against bits per weight (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def plot_kld_vs_bpw(rows: list[dict], title: str, path: str | Path) -> None:
    """Mean KL (log scale) against decoder bpw. Each row: {"label", "method", "bpw",
    "kl_mean", "kl_p99"}; EXL3 rows form a line (p99 dashed beside it), the other
    methods are single labelled markers. Rows without a KL (failed) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("kl_mean") is not None and r.get("bpw") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    exl3 = sorted((r for r in rows if r["method"] == "exl3"), key=lambda r: r["bpw"])
    floor = 1e-6  # a log axis cannot show 0; exact zeros sit on the floor
    if exl3:
        xs = [r["bpw"] for r in exl3]
        ax.plot(xs, [max(r["kl_mean"], floor) for r in exl3], "o-", color="#2b6cb0", label="EXL3 (mean KL)")
        ax.plot(xs, [max(r["kl_p99"], floor) for r in exl3], "--", color="#63b3ed", label="EXL3 (p99 KL)")
        for r in exl3:
            ax.annotate(r["label"], (r["bpw"], max(r["kl_mean"], floor)), textcoords="offset points",
                        xytext=(4, 6), fontsize=7)
    markers = {"int8": ("s", "#2f855a"), "gguf_q4": ("D", "#805ad5")}
    for r in rows:
        if r["method"] == "exl3":
            continue
        marker, color = markers.get(r["method"], ("^", "#c05621"))
        ax.plot([r["bpw"]], [max(r["kl_mean"], floor)], marker, color=color, label=f"{r['label']} (mean KL)")
    ax.set_yscale("log")
    ax.set_xlabel("decoder bits per weight")
    ax.set_ylabel("KL(teacher || student), nats per token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

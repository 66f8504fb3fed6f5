"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_ppl(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """Perplexity vs length on a log x axis, the training length marked."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["length"] for r in rows], [r["ppl"] for r in rows], marker="o")
    if train_seq_len:
        ax.axvline(train_seq_len, color="gray", linestyle="--", label=f"training length {train_seq_len}")
        ax.legend()
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["length"] for r in rows], [short_length(r["length"]) for r in rows])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # the path may be a temp name
    plt.close(fig)


def plot_passkey(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """NIAH-style heatmap: depth (rows) x length (columns), colour = accuracy."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in rows:
        grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
    fig, ax = plt.subplots(figsize=(max(5.0, 2.0 + 0.8 * len(lengths)), max(3.5, 1.5 + 0.45 * len(depths))))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [short_length(n) + ("*" if n == train_seq_len else "") for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens; * = training length)")
    ax.set_ylabel("needle depth")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # the path may be a temp name
    plt.close(fig)


def short_length(n: int) -> str:
    """``1048576`` -> ``1M``, ``4096`` -> ``4K``; other numbers unchanged."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)

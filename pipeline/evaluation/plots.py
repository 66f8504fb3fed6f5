"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_ppl(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """Perplexity of the same scored tokens vs context length (log2 x axis), the training length marked and the
    whole-document perplexity as a dashed horizontal line."""
    plot_ppl_models({"": rows}, train_seq_len, title, path)


def plot_ppl_models(rows_by_model: dict[str, list[dict]], train_seq_len: int | None, title: str, path: Path) -> None:
    """``plot_ppl`` for several models on one axes: one line per model (labelled by its name, if not empty), each
    model's document perplexity a dashed line in its colour."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lengths: set[int] = set()
    for model, rows in rows_by_model.items():
        context = sorted((r for r in rows if r.get("kind") == "context"), key=lambda r: r["length"])
        lengths.update(r["length"] for r in context)
        line = ax.plot([r["length"] for r in context], [r["ppl"] for r in context], marker="o", label=model or None)
        for r in rows:
            if r.get("kind") == "document":
                name = f"{model}: " if model else ""
                ax.axhline(r["ppl"], color=line[0].get_color(), linestyle=":", label=f"{name}whole documents")
    if train_seq_len:
        ax.axvline(train_seq_len, color="gray", linestyle="--", label=f"training length {train_seq_len}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [short_length(n) for n in sorted(lengths)])
    ax.set_xlabel("context length (tokens; the same final tokens scored at each)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
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


def plot_ruler(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """RULER heatmap: task (rows) x length (columns), colour = ``string_match_all``."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    grid = np.full((len(tasks), len(lengths)), np.nan)
    for r in rows:
        grid[tasks.index(r["task"]), lengths.index(r["length"])] = r["string_match_all"]
    fig, ax = plt.subplots(figsize=(max(5.5, 3.0 + 0.8 * len(lengths)), max(3.5, 1.5 + 0.45 * len(tasks))))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(tasks)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [short_length(n) + ("*" if n == train_seq_len else "") for n in lengths])
    ax.set_yticks(range(len(tasks)), tasks)
    ax.set_xlabel("context length (tokens; * = training length)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="string_match_all")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # the path may be a temp name
    plt.close(fig)


def short_length(n: int) -> str:
    """``1048576`` -> ``1M``, ``4096`` -> ``4K``; other numbers unchanged."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)

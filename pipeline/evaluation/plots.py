"""PNG plots of evaluation results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from data_prep.safe_write import replacing  # noqa: E402


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
    with replacing(path) as png:
        fig.savefig(png, dpi=120, format="png")
    plt.close(fig)


def plot_passkey(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """NIAH-style heatmap: depth (rows) x length (columns), colour = accuracy."""
    depths = sorted({r["depth"] for r in rows})
    cells = {(r["depth"], r["length"]): r["accuracy"] for r in rows}
    labels = [f"{d:.0%}" for d in depths]
    _heatmap(
        cells, depths, labels, train_seq_len, title, path, ylabel="needle depth", colour="accuracy", width=(5.0, 2.0)
    )


def plot_ruler(rows: list[dict], train_seq_len: int | None, title: str, path: Path) -> None:
    """RULER heatmap: task (rows) x length (columns), colour = each task's ``score`` (its RULER metric)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cells = {(r["task"], r["length"]): r["score"] for r in rows}
    _heatmap(cells, tasks, tasks, train_seq_len, title, path, ylabel=None, colour="score", width=(5.5, 3.0))


def _heatmap(
    cells: dict[tuple[Any, int], float],
    keys: list,
    labels: list[str],
    train_seq_len: int | None,
    title: str,
    path: Path,
    *,
    ylabel: str | None,
    colour: str,
    width: tuple[float, float],
) -> None:
    """Rows ``keys`` (shown as ``labels``) x context lengths, each cell's score in [0, 1] coloured and written as a
    percentage; the training length's column is starred. ``width``: the figure's least width and its width before
    0.8 inch a length column (inches)."""
    lengths = sorted({n for _, n in cells})
    grid = np.full((len(keys), len(lengths)), np.nan)
    for (key, length), value in cells.items():
        grid[keys.index(key), lengths.index(length)] = value
    least, base = width
    fig, ax = plt.subplots(figsize=(max(least, base + 0.8 * len(lengths)), max(3.5, 1.5 + 0.45 * len(keys))))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(len(keys)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{100 * grid[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [short_length(n) + ("*" if n == train_seq_len else "") for n in lengths])
    ax.set_yticks(range(len(keys)), labels)
    ax.set_xlabel("context length (tokens; * = training length)")
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=colour)
    fig.tight_layout()
    with replacing(path) as png:
        fig.savefig(png, dpi=120, format="png")
    plt.close(fig)


def short_length(n: int) -> str:
    """``1048576`` -> ``1M``, ``4096`` -> ``4K``; other numbers unchanged."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)

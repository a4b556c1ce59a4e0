"""Figures written next to results.json: the NIAH heat map and the PG-19 perplexity curve (Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from mtrain_cli.eval.results import length_label


def niah_heatmap(
    path: Path, lengths: list[int], depths: list[int], scores: dict[tuple[int, int], float], title: str
) -> None:
    """scores[(length, depth)] in percent; missing cells are left blank."""
    grid = [[scores.get((length, depth), float("nan")) for length in lengths] for depth in depths]
    figure, axes = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)))
    image = axes.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    axes.set_xticks(range(len(lengths)), [length_label(length) for length in lengths])
    axes.set_yticks(range(len(depths)), [f"{depth}%" for depth in depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth")
    axes.set_title(title)
    for row, depth in enumerate(depths):
        for column, length in enumerate(lengths):
            value = scores.get((length, depth))
            if value is not None:
                axes.text(column, row, f"{value:.0f}", ha="center", va="center", fontsize=8)
    figure.colorbar(image, ax=axes, label="needle found (%)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def perplexity_curve(path: Path, lengths: list[int], perplexities: list[float], title: str) -> None:
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(lengths, perplexities, marker="o")
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [length_label(length) for length in lengths])
    axes.set_xlabel("evaluation length (tokens)")
    axes.set_ylabel("perplexity")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

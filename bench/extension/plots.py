"""Figures of the extension experiment (drawn by report.py at the end; not run on its own):
perplexity against length for the four models, the NIAH heat maps side by side (each drawn by mtrain eval's own
`niah_heatmap`), the training curves (loss, tokens/s, sparse density and recall per step), and the sparse run's
density and recall per decoder layer over its steps."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from PIL import Image

from bench.extension.markdown import MODELS, label
from mtrain_cli.eval import niah_heatmap

STYLE = {
    "base": ("grey", ":"),
    "base-yarn": ("tab:orange", "--"),
    "dense": ("tab:blue", "-"),
    "sparse": ("tab:red", "-"),
    "sparse-prefill": ("tab:red", "--"),
}  # model -> (colour, line style)


def save(figure, path: Path, dpi: int) -> None:
    """A PNG of at most 256 colours (the figures have few): a third of the bytes of matplotlib's RGBA."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    plt.close(figure)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, optimize=True)


def perplexity_plot(payload: dict[str, Any], path: Path) -> bool:
    table = payload["quality"]["table"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for model in MODELS:
        cells = table.get(model, {}).get("perplexity") or {}
        if cells:
            lengths = sorted(cells)
            color, line = STYLE[model]
            axes.plot(lengths, [cells[n] for n in lengths], marker="o", color=color, linestyle=line, label=model)
            drawn = True
    if not drawn:
        plt.close(figure)
        return False
    lengths = payload.get("lengths") or []
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(lengths, [label(n) for n in lengths])
    axes.axvline(payload.get("base_context", 0), color="grey", linewidth=0.8, alpha=0.5)
    axes.set_xlabel("evaluation length (tokens); vertical line: the base context")
    axes.set_ylabel("perplexity, held-out packages")
    axes.set_title(f"Perplexity by length ({payload.get('gpu_name')})")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    save(figure, path, 120)
    return True


def niah_plot(payload: dict[str, Any], tmp_dir: Path, path: Path) -> bool:
    """One `niah_heatmap` per model (the same figure mtrain eval writes), laid side by side."""
    grids = payload["quality"]["niah_grid"]
    panels = []
    for model in MODELS:
        if grids.get(model):
            scores = {tuple(map(int, key.split(":"))): value for key, value in grids[model].items()}
            lengths, depths = sorted({n for n, _ in scores}), sorted({d for _, d in scores})
            panel = tmp_dir / f"niah_{model}.png"
            niah_heatmap(panel, lengths, depths, scores, f"NIAH: {model}")
            panels.append(panel)
    if not panels:
        return False
    images = [plt.imread(panel) for panel in panels]
    widths = [image.shape[1] for image in images]  # one column per length: panels as wide as they were drawn
    figure, axes = plt.subplots(
        1, len(images), figsize=(sum(widths) / 120, 6), squeeze=False, gridspec_kw={"width_ratios": widths}
    )
    for axis, image in zip(axes[0], images):
        axis.imshow(image)
        axis.axis("off")
    figure.tight_layout()
    save(figure, path, 120)
    return True


def training_plot(payload: dict[str, Any], path: Path) -> bool:
    runs = payload["training"]
    if not runs:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = (
        (axes[0][0], "loss", ("dense", "sparse"), "extension: training loss"),
        (axes[0][1], "tokens_per_s", ("dense", "sparse"), "extension: tokens/s"),
        (axes[1][0], "sparse_density", ("sparse",), "sparse extension: density (mean over layers)"),
        (axes[1][1], "loss", ("base",), "base pretraining: training loss"),
    )
    for axis, key, names, title in panels:
        for name in names:
            curve = [
                (point["step"], point[key])
                for point in (runs.get(name) or {}).get("curve", [])
                if point.get(key) is not None
            ]
            if curve:
                axis.plot(*zip(*curve), color=STYLE[name][0], label="density" if key == "sparse_density" else name)
        if key == "sparse_density":
            curve = [
                (point["step"], point["sparse_recall"])
                for point in (runs.get("sparse") or {}).get("curve", [])
                if point.get("sparse_recall") is not None
            ]
            if curve:
                axis.plot(*zip(*curve), color="black", linestyle="--", label="recall")
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(True, alpha=0.3)
        if axis.has_data():
            axis.legend()
    figure.tight_layout()
    save(figure, path, 110)
    return True


def layers_plot(payload: dict[str, Any], path: Path) -> bool:
    """Density and recall of each decoder layer's sparse plans over the sparse run's steps, a running mean over
    a 25th of the run (one step's plan varies with its one sequence)."""
    curve = (payload["training"].get("sparse") or {}).get("layer_curve")
    if not curve:
        return False
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    window = max(1, max(len(points) for points in curve.values()) // 25)
    colours = plt.get_cmap("viridis")
    for index, (layer, points) in enumerate(curve.items()):
        steps = [point[0] for point in points]
        for axis, column in ((axes[0], 2), (axes[1], 1)):
            values = [point[column] for point in points]
            smooth = [
                sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                for i in range(len(values))
            ]
            axis.plot(steps, smooth, color=colours(index / max(1, len(curve) - 1)), label=f"layer {layer}")
    for axis, what in (
        (axes[0], "block density (share of causal blocks computed)"),
        (axes[1], "recall (attention mass the layout keeps)"),
    ):
        axis.set_title(f"sparse extension: {what}", fontsize=10)
        axis.set_xlabel(f"step (running mean over {window})")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylim(0, 1.02)
    axes[1].legend(fontsize=8, ncol=2)
    figure.tight_layout()
    save(figure, path, 110)
    return True


def plot_all(payload: dict[str, Any], tmp_dir: Path, out: Path, stem: str) -> list[str]:
    """-> the names of the figures written to `out`."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, draw in (
        ("ppl", lambda p: perplexity_plot(payload, p)),
        ("niah", lambda p: niah_plot(payload, tmp_dir, p)),
        ("training", lambda p: training_plot(payload, p)),
        ("layers", lambda p: layers_plot(payload, p)),
    ):
        name = f"{stem}_{suffix}.png"
        if draw(out / name):
            written.append(name)
    return written

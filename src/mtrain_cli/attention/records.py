"""What attention actually ran, kept by the router: calls per path, and the sparse plans' recall, density and
work, read out (and reset) once per training step or eval prefill.

Per-plan values stay on the device until read, so recording a layer never waits for it; `sparse_stats` reads
them all with one host wait. A plan's density and work are recorded as zero-argument functions and computed
when read: each is a few dozen small kernels, whose launches in the forward would hold the GPU back (a sparse
layer's kernels run faster than the host launches a plan); a training step reads them after its optimizer's
kernels are launched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionRecords:
    calls_by_path: Counter[str] = field(default_factory=Counter)
    recall: list[torch.Tensor] = field(default_factory=list)  # per fresh plan, kept on device until read
    recall_layers: list[int | None] = field(default_factory=list)  # the decoder layer of each (module.layer_idx)
    density: list[Callable[[], torch.Tensor] | torch.Tensor] = field(default_factory=list)  # per plan
    work: list[Callable[[], torch.Tensor] | torch.Tensor | float] = field(default_factory=list)  # per fresh layer
    # call: its plan's work share, or 1.0 (ran dense)
    num_short: int = 0  # of those dense, the calls on a batch without a document of dense_below tokens
    ring_work: float = 0.0  # active blocks this rank's ring plans compute (for the cp imbalance)

    def sparse_stats(self) -> dict[str, Any]:
        """Since the last call (then reset): mean recall and density of the sparse plans that ran, and both per
        decoder layer (`sparse_by_layer`); for single-process sparse layers, how many fresh layer calls ran
        sparse, how many dense by the crossover rule (`dense_layers`) and how many dense on a batch without a
        long document (`short_layers`), and `attention_work`, the share of dense attention's work they computed
        (1 for a dense layer); the ring work (active blocks) of this rank's ring plans. Empty when no sparse
        layer ran."""
        stats: dict[str, Any] = {}
        density = [d() if callable(d) else d for d in self.density]
        work = [w() if callable(w) else w for w in self.work]
        on_device = [*self.recall, *density, *(w for w in work if isinstance(w, torch.Tensor))]
        values = (
            torch.stack([t.float().to(on_device[0].device) for t in on_device]).tolist()  # one host wait
            if on_device
            else []
        )
        num_recall = len(self.recall)
        if num_recall:
            recall, density = values[:num_recall], values[num_recall : 2 * num_recall]
            stats["sparse_recall"] = sum(recall) / num_recall
            stats["sparse_density"] = sum(density) / num_recall
            stats["sparse_by_layer"] = _by_layer(self.recall_layers, recall, density)
        if work:
            sparse_work = iter(values[2 * num_recall :])
            shares = [w if isinstance(w, float) else next(sparse_work) for w in work]
            stats["attention_work"] = sum(shares) / len(shares)
            stats["sparse_layers"] = sum(not isinstance(w, float) for w in work)
            stats["short_layers"] = self.num_short
            stats["dense_layers"] = len(shares) - stats["sparse_layers"] - self.num_short
        if self.ring_work:
            stats["ring_work"] = self.ring_work
        self.clear()
        return stats

    def clear(self) -> None:
        """Drop the plans' records unread (e.g. validation's, before a training step)."""
        self.recall.clear()
        self.recall_layers.clear()
        self.density.clear()
        self.work.clear()
        self.num_short = 0
        self.ring_work = 0.0


def _by_layer(layers: list[int | None], recall: list[float], density: list[float]) -> dict[str, list[float]]:
    """{decoder layer: [mean recall, mean density]} over the plans of a layer (micro-batches); the keys are
    strings (JSON). Layers that ran dense, or modules without a layer index, are absent."""
    sums: dict[int, list[float]] = {}
    for layer, r, d in zip(layers, recall, density):
        if layer is not None:
            entry = sums.setdefault(layer, [0.0, 0.0, 0])
            entry[0], entry[1], entry[2] = entry[0] + r, entry[1] + d, entry[2] + 1
    return {str(layer): [r / n, d / n] for layer, (r, d, n) in sorted(sums.items())}

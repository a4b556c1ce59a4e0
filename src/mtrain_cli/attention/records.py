"""What attention actually ran, kept by the router: calls per path, where each sparse-mode layer went, and the
sparse plans' recall, density and work, read out (and reset) once per training step or eval prefill.

Per-plan values stay on the device until read, so recording a layer never waits for it; `sparse_stats` reads
them all with one host wait (`take_stats`, then `PendingStats.read`: the same in two halves). A plan's density and
work are recorded as zero-argument functions and computed when taken: each is a few dozen small kernels, whose
launches in the forward would hold the GPU back (a sparse layer's kernels run faster than the host launches a
plan); a training step takes them after launching its optimizer, and reads them after launching the next step.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Lazy = Callable[[], torch.Tensor] | torch.Tensor  # a device value, or how to compute it when read


class Route(str, enum.Enum):
    """Where a sparse-mode layer's attention went. Each value is the one name of its counter: in the step
    metrics (`layers`), the step line and summary.json (`attention_layers`)."""

    SPARSE = "sparse"  # its sparse plan ran
    DENSE_CROSSOVER = "dense-crossover"  # dense by the crossover rule: its plan would be slower
    DENSE_SHORT = "dense-short-documents"  # dense: the batch holds no document of dense_below tokens
    DENSE_LAYER = "dense-layer"  # dense: attention.dense_layers names the layer
    DENSE_RECALL = "dense-recall"  # dense: holding the recall target took more than attention.max_density
    DENSE_STEP = "dense-step"  # dense: a step of attention.dense_every, every layer dense


class CallPath(str, enum.Enum):
    """What served one attention call: the keys of `AttentionRouter.calls()` (summary.json's `attention_calls`).
    A fresh sparse-mode call that runs dense counts under its Route's value; a call that reuses its micro-batch's
    decision (the activation-checkpoint recompute) under the `*_REUSED` paths."""

    DENSE = "dense"  # dense mode
    DENSE_DECODE = "dense-decode"  # fewer queries than keys (a KV cache): dense in either mode
    SPARSE_TRITON = "sparse-triton"  # a sparse plan, run by the Triton kernels
    SPARSE_REFERENCE = "sparse-reference"  # ... by the plain-torch reference
    DENSE_CROSSOVER = Route.DENSE_CROSSOVER.value
    DENSE_SHORT = Route.DENSE_SHORT.value
    DENSE_LAYER = Route.DENSE_LAYER.value
    DENSE_RECALL = Route.DENSE_RECALL.value
    DENSE_STEP = Route.DENSE_STEP.value
    SPARSE_REUSED = "sparse-plan-reused"
    DENSE_CROSSOVER_REUSED = "dense-crossover-reused"
    DENSE_SHORT_REUSED = "dense-short-documents-reused"
    DENSE_LAYER_REUSED = "dense-layer-reused"
    DENSE_RECALL_REUSED = "dense-recall-reused"
    DENSE_STEP_REUSED = "dense-step-reused"
    RING_SPARSE = "ring-sparse"  # a ring of sparse mode (its plan: sparse, or the dense ring's for a dense route)
    RING_DENSE = "ring-dense"  # a ring of dense mode
    RING_REUSED = "ring-plan-reused"

    @classmethod
    def of_route(cls, route: Route, reused: bool) -> CallPath:
        """The counter of a single-process sparse-mode call routed `route` (a fresh sparse one counts under its
        engine's path instead)."""
        if route is Route.SPARSE:
            assert reused, "a fresh sparse call counts under its engine's path"
            return cls.SPARSE_REUSED
        return cls(f"{route.value}-reused" if reused else route.value)


# the paths on which sparse attention itself ran (a recompute that reuses its plan runs it again)
SPARSE_PATHS = (CallPath.SPARSE_TRITON, CallPath.SPARSE_REFERENCE)


@dataclass
class AttentionRecords:
    calls_by_path: Counter[CallPath] = field(default_factory=Counter)
    _recall: list[torch.Tensor] = field(default_factory=list)  # per fresh plan, kept on device until read
    _heads: list[torch.Tensor] = field(default_factory=list)  # per fresh plan [2, H]: recall and chosen entries
    # per head (the recall controller's observations)
    _recall_layers: list[int | None] = field(default_factory=list)  # the decoder layer of each (module.layer_idx)
    _density: list[Lazy] = field(default_factory=list)  # per fresh plan
    _work: list[Lazy | float] = field(default_factory=list)  # per fresh single-process layer call: its plan's
    # share of dense attention's work, or 1.0 (ran dense)
    _routes: Counter[Route] = field(default_factory=Counter)  # fresh sparse-mode layer calls
    _ring_work: list[Lazy] = field(default_factory=list)  # active blocks of each of this rank's fresh ring plans
    # (for the cp imbalance)

    def count_call(self, path: CallPath) -> None:
        self.calls_by_path[path] += 1

    def record_sparse(
        self, layer: int | None, recall_BH: torch.Tensor, chosen_BH: torch.Tensor, density: Lazy, work: Lazy
    ) -> None:
        """A fresh single-process sparse plan that runs: its recall and chosen entries per (row, head)."""
        self._record_plan(layer, recall_BH, chosen_BH, density)
        self._work.append(work)
        self._routes[Route.SPARSE] += 1

    def record_dense(self, route: Route) -> None:
        """A fresh sparse-mode layer call that runs dense attention (all of dense's work); over a ring, its dense
        ring plan is recorded too (record_ring)."""
        assert route is not Route.SPARSE
        self._work.append(1.0)
        self._routes[route] += 1

    def record_ring(
        self,
        layer: int | None,
        recall_BH: torch.Tensor | None,
        chosen_BH: torch.Tensor | None,
        density: Lazy | None,
        work: Lazy,
    ) -> None:
        """A fresh ring plan: its pattern's recall and density (a sparse plan, whose density is its share of dense
        attention's work), and the active blocks this rank computes."""
        if recall_BH is not None:
            self._record_plan(layer, recall_BH, chosen_BH, density)
            self._work.append(density)
            self._routes[Route.SPARSE] += 1
        self._ring_work.append(work)

    def _record_plan(self, layer: int | None, recall_BH: torch.Tensor, chosen_BH: torch.Tensor, density: Lazy) -> None:
        self._recall.append(recall_BH.mean())
        self._heads.append(torch.stack([recall_BH.float().mean(0), chosen_BH.float().amax(0)]))
        self._recall_layers.append(layer)
        self._density.append(density)

    def sparse_stats(self) -> dict[str, Any]:
        """Since the last call (then reset): mean recall and density of the sparse plans that ran, and both per
        decoder layer (`sparse_by_layer`); for single-process sparse-mode layers, the fresh layer calls by Route
        (`layers`) and `attention_work`, the share of dense attention's work they computed (1 for a dense layer);
        the ring work (active blocks) of this rank's ring plans. Empty when no sparse-mode layer ran."""
        return self.take_stats().read()

    def take_stats(self) -> PendingStats:
        """sparse_stats in two halves: this one launches the deferred accounting (the density and work of each
        plan) and gathers every value into one fresh device tensor, then resets; PendingStats.read waits for it.
        A training step takes its stats after launching its optimizer and reads them after launching the next
        step: later plans (a CUDA graph's replays reuse its buffers) cannot change them."""
        density = [d() if callable(d) else d for d in self._density]
        work = [w() if callable(w) else w for w in self._work]
        ring_work = [w() if callable(w) else w for w in self._ring_work]
        on_device = [*self._recall, *density, *(w for w in work if isinstance(w, torch.Tensor)), *ring_work]
        values = torch.stack([t.float().to(on_device[0].device) for t in on_device]) if on_device else None
        if self._heads:
            values = torch.cat([values, torch.stack(self._heads).flatten()])
        ready = None
        if values is not None and values.is_cuda:
            # to pinned host memory without blocking: reading it waits for this copy alone, not for the kernels
            # launched after it (reading a device tensor would wait for the next step's too)
            values = values.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        pending = PendingStats(
            values,
            ready,
            list(self._recall_layers),
            [w if isinstance(w, float) else None for w in work],
            {route.value: self._routes[route] for route in Route},
            bool(ring_work),
            sum(h.numel() for h in self._heads),
        )
        self.clear()
        return pending

    def clear(self) -> None:
        """Drop the plans' records unread (e.g. validation's, before a training step)."""
        self._recall.clear()
        self._heads.clear()
        self._recall_layers.clear()
        self._density.clear()
        self._work.clear()
        self._routes.clear()
        self._ring_work.clear()


@dataclass(frozen=True)
class PendingStats:
    """A step's plan records, taken (AttentionRecords.take_stats) and not yet read."""

    values: torch.Tensor | None  # on the host (pinned, arriving by `ready`): recall of each plan, its density,
    # the work of each sparse call, ring work
    ready: torch.cuda.Event | None  # recorded after the copy of `values` (CUDA)
    recall_layers: list[int | None]
    work: list[float | None]  # per fresh single-process layer call: 1.0 (ran dense), None (a value above)
    routes: dict[str, int]
    ring: bool  # ring plans ran: the values end with their work (before the heads')
    num_head_values: int = 0  # the values end with each plan's [2, H] per-head recall and chosen entries

    def read(self) -> dict[str, Any]:
        """-> the stats (AttentionRecords.sparse_stats), once the copy of `values` has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        stats: dict[str, Any] = {}
        values = self.values.tolist() if self.values is not None else []
        if self.num_head_values:
            values, head_values = values[: -self.num_head_values], values[-self.num_head_values :]
            stats["by_head"] = _by_head(self.recall_layers, head_values)
        num_recall = len(self.recall_layers)
        if num_recall:
            recall, density = values[:num_recall], values[num_recall : 2 * num_recall]
            stats["sparse_recall"] = sum(recall) / num_recall
            stats["sparse_density"] = sum(density) / num_recall
            stats["sparse_by_layer"] = _by_layer(self.recall_layers, recall, density)
        sparse_work = iter(values[2 * num_recall :])
        if self.work:
            shares = [w if w is not None else next(sparse_work) for w in self.work]
            stats["attention_work"] = sum(shares) / len(shares)
            stats["layers"] = self.routes
        if self.ring:
            stats["ring_work"] = sum(sparse_work)
        return stats


def _by_layer(layers: list[int | None], recall: list[float], density: list[float]) -> dict[str, list[float]]:
    """{decoder layer: [mean recall, mean density]} over the plans of a layer (micro-batches); the keys are
    strings (JSON). Layers that ran dense, or modules without a layer index, are absent."""
    sums: dict[int, list[float]] = {}
    for layer, r, d in zip(layers, recall, density):
        if layer is not None:
            entry = sums.setdefault(layer, [0.0, 0.0, 0])
            entry[0], entry[1], entry[2] = entry[0] + r, entry[1] + d, entry[2] + 1
    return {str(layer): [r / n, d / n] for layer, (r, d, n) in sorted(sums.items())}


def _by_head(layers: list[int | None], head_values: list[float]) -> dict[int, tuple[list[float], list[float], int]]:
    """{decoder layer: (mean recall per head, most entries chosen per head, plans)} over the plans of a layer (the
    recall controller's observations; not logged)."""
    num_heads = len(head_values) // (2 * len(layers))
    out: dict[int, tuple[list[float], list[float], int]] = {}
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        recall = head_values[2 * i * num_heads : (2 * i + 1) * num_heads]
        chosen = head_values[(2 * i + 1) * num_heads : (2 * i + 2) * num_heads]
        if layer in out:
            sums, most, n = out[layer]
            out[layer] = ([a + b for a, b in zip(sums, recall)], [max(a, b) for a, b in zip(most, chosen)], n + 1)
        else:
            out[layer] = (recall, chosen, 1)
    return {layer: ([r / n for r in sums], most, n) for layer, (sums, most, n) in out.items()}

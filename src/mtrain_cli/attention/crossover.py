"""When dense attention beats sparse: a cost model of a sparse layer relative to dense, per length and head dim.

A sparse layer costs its plan (probe, pattern, layout), the kernels' per-row passes, and the blocks they
compute. Blocks come two ways, at different prices: ranges (slash and dense blocks, loaded as whole tiles)
and vertical columns (gathered a row at a time, in chunks). With r and v the range and vertical work as
shares of dense attention's (SparsePlan.work_split_bound), a layer costs, relative to dense attention,

    (plan + fixed) / visible + per_range·r + per_vertical·v

(visible: dense attention's work over the causal triangle, 1 for one document per row, about 1/n for n packed
documents), and sparse runs while that is below PAYS_BELOW. `mtrain profile crossover` measures dense attention and
our kernels at full range work, full vertical work and on two real plans, and fits the four terms per length and
head dim; the table below is that run (bench/results/crossover_h100.json: one H100, bf16, one document per row,
dense = SDPA's causal kernel). Packed rows run dense through FlexAttention, slower per block than SDPA, so the
one-document costs are the conservative side for them.

In training on a GPU, a layer whose plan does not pay runs dense attention and re-plans only every
REPROBE_EVERY forwards (a nearly dense model, e.g. one randomly initialised, would otherwise lose a plan per
layer per step to sparse mode). A layer that runs sparse is judged by its previous plan, read without waiting
for the device; only a layer's first plan (and its first after a dense stretch) makes the host wait. Lengths
where even a plan of NEVER_SPARSE work does not pay do not plan at all.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module stays torch-free: the CLI checks --head-dims against it before importing torch
    import torch

    from mtrain_cli.attention.sparse.layout import HostCopy
    from mtrain_cli.attention.sparse.ops import SparsePlan

REPROBE_EVERY = 8  # forwards between plans of a layer that last ran dense (attention patterns drift slowly)
MEASURED_HEADS = {64: (14, 2), 128: (16, 2)}  # head dim -> (query, KV heads): Qwen2.5-0.5B's and -3B's shapes
MEASURED_BLOCK = 64  # the layout block the table was measured at (the default; other blocks cost otherwise)
NEVER_SPARSE = 0.02  # the least range work a plan computes (sinks and a local window), as a share of dense
PAYS_BELOW = 0.85  # sparse runs only where the model predicts it 15% faster: on real models (bench/results/
# gpu_e2e_h100.json) the one-document fit was up to ~12% optimistic (other head counts, compile, host gaps)


@dataclass(frozen=True)
class SparseCost:
    """A sparse layer's forward+backward time relative to dense attention's, term by term."""

    plan: float  # pattern estimation and layout
    fixed: float  # the kernels' per-row passes, whatever the work
    per_range: float  # at range work share 1 (every visible block as a tile)
    per_vertical: float  # at vertical work share 1 (every visible column gathered)

    def relative(self, range_share: float, vertical_share: float, visible_share: float = 1.0) -> float:
        """visible_share: dense attention's work over the causal triangle (packed documents: about 1/n). The
        plan and the per-row passes cost the same either way, so they weigh more against a packed row's
        cheaper dense attention."""
        return (
            (self.plan + self.fixed) / visible_share + self.per_range * range_share + self.per_vertical * vertical_share
        )

    def pays(self, range_share: float, vertical_share: float, visible_share: float = 1.0) -> bool:
        return self.relative(range_share, vertical_share, visible_share) < PAYS_BELOW

    @property
    def never_pays(self) -> bool:
        return not self.pays(NEVER_SPARSE, 0.0)


# head dim -> [(sequence length, cost)], ascending lengths: bench/results/crossover_h100.json "table"
COSTS_H100: dict[int, list[tuple[int, SparseCost]]] = {
    64: [
        (8192, SparseCost(plan=0.9748, fixed=0.8559, per_range=1.1396, per_vertical=2.5358)),
        (16384, SparseCost(plan=0.3951, fixed=0.2368, per_range=1.1799, per_vertical=5.6182)),
        (32768, SparseCost(plan=0.1013, fixed=0.0623, per_range=1.2931, per_vertical=3.2039)),
        (65536, SparseCost(plan=0.0287, fixed=0.0204, per_range=1.4024, per_vertical=3.2783)),
        (131072, SparseCost(plan=0.0083, fixed=0.0104, per_range=1.3421, per_vertical=3.3398)),
    ],
    128: [
        (8192, SparseCost(plan=0.7153, fixed=0.4608, per_range=1.4914, per_vertical=2.4585)),
        (16384, SparseCost(plan=0.2105, fixed=0.1626, per_range=1.2361, per_vertical=2.7103)),
        (32768, SparseCost(plan=0.0491, fixed=0.06, per_range=1.3045, per_vertical=3.876)),
        (65536, SparseCost(plan=0.014, fixed=0.0189, per_range=1.3489, per_vertical=2.644)),
        (131072, SparseCost(plan=0.0068, fixed=0.014, per_range=1.2366, per_vertical=2.4314)),
    ],
}


def sparse_cost(
    seq_len: int, head_dim: int, table: dict[int, list[tuple[int, SparseCost]]] | None = None
) -> SparseCost:
    """Each term linear in log2(length) between measured lengths, the end values beyond them (shorter: the
    shortest's, where plans cost relatively most; longer: the longest's, since sparse only gains with
    length). The nearest measured head dim."""
    table = COSTS_H100 if table is None else table
    nearest = min(table, key=lambda d: (abs(math.log2(d) - math.log2(head_dim)), d))
    points = table[nearest]
    lengths = [length for length, _ in points]
    i = bisect.bisect_left(lengths, seq_len)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (s0, c0), (s1, c1) = points[i - 1], points[i]
    t = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
    return SparseCost(*((1 - t) * getattr(c0, f.name) + t * getattr(c1, f.name) for f in fields(SparseCost)))


# The crossover rule: (sequence length, head dim) -> the cost of a sparse layer relative to dense.
CostRule = Callable[[int, int], SparseCost]


def crossover_rule(device: torch.device) -> CostRule | None:
    """The rule a trainer on `device` applies: the measured GPU table on CUDA; none on CPU, where sparse mode
    runs the plain-torch reference (a test oracle, not a speed path)."""
    return sparse_cost if device.type == "cuda" else None


class CrossoverPolicy:
    """The crossover rule applied to each decoder layer over a run, and its memory of each layer: the forward it
    was last judged dense at, or its last sparse plan's work split. The memory is saved in checkpoints
    (`state_dict`), so a resumed run routes every layer as the uninterrupted run would. Its clock is the count
    of forwards (micro-batches) started."""

    def __init__(self, cost_of: CostRule):
        self.cost_of = cost_of
        self.num_forwards = 0
        self._dense_since: dict[int, int] = {}  # layer -> forward it was last judged dense
        self._last_split: dict[int, HostCopy] = {}  # layer -> its last sparse plan's work split (range, vertical)

    def start_forward(self) -> None:
        self.num_forwards += 1

    def plan_or_dense(
        self, layer: int, seq_len: int, head_dim: int, make_plan: Callable[[], SparsePlan]
    ) -> SparsePlan | None:
        """The layer's sparse plan, or None where dense attention is the faster choice. Plans only where the rule
        has not already decided: a layer in its dense stretch, or whose previous plan did not pay, is not planned.
        A layer that runs sparse is judged by its previous plan (copied a forward ago: no wait); only a first plan
        makes the host wait for its work split."""
        from mtrain_cli.attention.sparse.layout import HostCopy

        cost = self.cost_of(seq_len, head_dim)
        last_dense = self._dense_since.get(layer)
        if cost.never_pays or (last_dense is not None and self.num_forwards - last_dense < REPROBE_EVERY):
            return None
        previous = self._last_split.pop(layer, None)
        if previous is not None and not cost.pays(*previous.get()):
            self._dense_since[layer] = self.num_forwards
            return None
        plan = make_plan()
        split = plan.work_split_bound()
        if previous is None and not cost.pays(*split.tolist()):
            self._dense_since[layer] = self.num_forwards
            return None
        self._last_split[layer] = HostCopy(split)
        self._dense_since.pop(layer, None)
        return plan

    def state_dict(self) -> dict[str, Any]:
        """Reads the last work splits back from the device: once per checkpoint."""
        return {
            "num_forwards": self.num_forwards,
            "dense_since": dict(self._dense_since),
            "last_split": {layer: split.get() for layer, split in self._last_split.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What `state_dict` saved; {} (a checkpoint of a run without the rule) leaves the memory empty."""
        if not state:
            return
        import torch

        from mtrain_cli.attention.sparse.layout import HostCopy

        self.num_forwards = state["num_forwards"]
        self._dense_since = dict(state["dense_since"])
        self._last_split = {  # float64 holds the saved values exactly, whatever the split's dtype was
            layer: HostCopy(torch.tensor(split, dtype=torch.float64)) for layer, split in state["last_split"].items()
        }

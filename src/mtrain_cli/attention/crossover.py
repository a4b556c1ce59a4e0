"""When dense attention beats sparse: the crossover work share, per sequence length and head dim.

A sparse layer costs its plan (probe, pattern, layout) plus kernels whose time grows with the blocks they
compute; dense attention costs a fixed time per length. With `full` the sparse kernels' time when they
compute every block a row may see, a layer whose plan computes share w of that work costs about
plan + w·full, so sparse pays while w < (dense − plan) / full: the crossover. `mtrain profile crossover`
measures the three times on a GPU; the table below is that run (bench/results/crossover_h100.json, one H100,
bf16, one document per row, dense = SDPA's default causal kernel). Packed rows run dense through
FlexAttention, slower per block than SDPA, so the one-document crossover is the conservative side for them.

In training on a GPU, a layer whose plan is above the crossover runs dense attention for that step and
re-plans only every REPROBE_EVERY forwards (a plan costs 1-3 ms a layer: paid every step for nothing, a
nearly dense model, e.g. one randomly initialised, would lose that much to sparse mode). Lengths whose
crossover is at or below NEVER_SPARSE do not plan at all.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch

REPROBE_EVERY = 8  # forwards between plans of a layer that last ran dense (attention patterns drift slowly)
NEVER_SPARSE = 0.02  # below this share even a sink + local window plan does not pay

# head dim -> [(sequence length, crossover work share)], ascending lengths
CROSSOVER_H100: dict[int, list[tuple[int, float]]] = {
    64: [(8192, 0.0), (16384, 0.374), (32768, 0.691), (65536, 0.673), (131072, 0.719)],
    128: [(8192, 0.0), (16384, 0.522), (32768, 0.742), (65536, 0.726), (131072, 0.791)],
}


def crossover_share(seq_len: int, head_dim: int, table: dict[int, list[tuple[int, float]]] = CROSSOVER_H100) -> float:
    """The work share above which dense is faster at this length: linear in log2(length) between measured
    lengths, the end values beyond them (shorter: the shortest's, which favours dense since plans cost
    relatively more there; longer: the longest's, since sparse only gains with length). The nearest
    measured head dim."""
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
    return c0 + t * (c1 - c0)


def crossover_rule(device: torch.device) -> Callable[[int, int], float] | None:
    """The rule a trainer on `device` applies: the measured GPU table on CUDA; none on CPU, where sparse mode
    runs the plain-torch reference (a test oracle, not a speed path)."""
    return crossover_share if device.type == "cuda" else None

"""The per-layer plan as one CUDA graph: captured on a batch's first layer, replayed by the others.

Pattern estimation + block layout is ~450 small kernels whose launch gaps, not their arithmetic, set its
cost on a GPU (about 3 ms per layer at 32K, where the attention itself takes 8 ms). Its shapes depend only
on the batch's geometry and the q/k shapes (every list is padded to a host-known bound and nothing syncs
with the host), so one capture per batch serves all of its layers: each layer copies its probe queries and
keys into the graph's inputs, replays it, and clones the outputs, since every layer keeps its own layout
for backward. Only the last batch's graph is kept (its memory pool holds the plan's buffers).

One process only: a context-parallel ring runs the same estimator eagerly, since its reduce is a collective
(attention/ring/cp_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.layout import LayoutArrays, LayoutGeometry, layout_arrays
from mtrain_cli.attention.sparse.pattern import ProbeRows, estimate_from_probes


@dataclass
class _Captured:
    key: tuple
    anchor: object  # the batch geometry the graph reads: kept alive, and compared by identity
    graph: torch.cuda.CUDAGraph
    probe_BHQD: torch.Tensor  # inputs, overwritten before each replay
    k_BHkSD: torch.Tensor
    arrays: LayoutArrays  # outputs, overwritten by each replay
    recall_BH: torch.Tensor


class PlanGraph:
    """The last batch's captured plan (the attention router owns one)."""

    def __init__(self):
        self.captured: _Captured | None = None

    def replay(
        self,
        probe_BHQD: torch.Tensor,
        k_BHkSD: torch.Tensor,
        rows: ProbeRows,
        geometry: LayoutGeometry,
        anchor: object,
        scale: float,
        settings: AttentionConfig,
    ) -> tuple[LayoutArrays, torch.Tensor]:
        """-> (layout arrays, recall) of `estimate_from_probes` + `layout_arrays`, by replaying a captured graph.

        anchor: the object that owns rows and geometry for this batch (a new one means a new capture)."""
        key = (probe_BHQD.shape, probe_BHQD.dtype, k_BHkSD.shape, k_BHkSD.dtype, k_BHkSD.device, scale, settings)
        last = self.captured
        if last is None or last.anchor is not anchor or last.key != key:
            self.captured = last = None  # release the previous graph's pool before capturing the next
            self.captured = last = _capture(key, anchor, probe_BHQD, k_BHkSD, rows, geometry, scale, settings)
        last.probe_BHQD.copy_(probe_BHQD)
        last.k_BHkSD.copy_(k_BHkSD)
        last.graph.replay()
        return LayoutArrays(*(t.clone() for t in last.arrays)), last.recall_BH.clone()


def _capture(
    key: tuple,
    anchor: object,
    probe_BHQD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    rows: ProbeRows,
    geometry: LayoutGeometry,
    scale: float,
    settings: AttentionConfig,
) -> _Captured:
    probe_in, k_in = probe_BHQD.clone(), k_BHkSD.clone()

    def plan() -> tuple[LayoutArrays, torch.Tensor]:
        pattern = estimate_from_probes(probe_in, k_in, rows, scale, settings)
        return layout_arrays(pattern, geometry), pattern.recall_BH

    # Captured on a side stream with capture_begin/end rather than `torch.cuda.graph`, whose entry syncs the
    # device and empties the allocator's cache: once per batch, in the middle of a training step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        plan()  # warm-up outside the capture: kernel compiles, library handles
        graph.capture_begin(capture_error_mode="thread_local")  # other threads (loggers) may use CUDA
        try:
            arrays, recall_BH = plan()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return _Captured(key, anchor, graph, probe_in, k_in, arrays, recall_BH)

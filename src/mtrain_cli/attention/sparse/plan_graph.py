"""The per-layer plan as one CUDA graph: captured once, replayed by every layer of every batch of its shapes.

Pattern estimation + block layout is ~450 small kernels whose launch gaps, not their arithmetic, set its
cost on a GPU (about 3 ms per layer at 32K, where the attention itself takes 8 ms). Its shapes depend only
on the batch's geometry and the q/k shapes (every list is padded to a host-known bound and nothing syncs
with the host), so one capture serves all the layers of a batch: each layer copies its probe queries and
keys into the graph's inputs, replays it, and clones the outputs, since every layer keeps its own layout
for backward. The batch's geometry (its probe rows and layout geometry) is an input too, copied into the
graph's own buffers when a batch of the same shapes comes (the same number of long documents per row at most,
so most batches of a run): the warm-up and capture, ~900 kernel launches from the host, the GPU idle during
the capture, are not paid again every step.
The graphs of the last MAX_GRAPHS shapes are kept: packed rows of one length differ in how many long documents
they hold (the probe rows' shapes), and a run's batches return to the same few counts, each of which would
otherwise re-capture (~27 ms of host time at 64K, the GPU waiting). The graphs share one memory pool, so their
buffers cost about one plan's: a replay reads only its own inputs (allocated outside the pool) and its outputs
are cloned before another graph replays, so one graph's scratch may overlap another's.

A context-parallel ring rank captures its plan the same way: the estimator's reduces are NCCL all_reduces,
captured into the graph and replayed by every rank in the same order (every rank plans the same layers of the
same batches), and the graph lays out all of the rank's chunk pairs (attention/ring/cp_attention.py). The
probe queries are reduced from a copy, so the graph's input survives a replay.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.layout import LayoutArrays, LayoutGeometry, layout_arrays
from mtrain_cli.attention.sparse.pattern import FlexLimits, Pattern, ProbeRows, estimate_from_probes
from mtrain_cli.attention.sparse.probe_keys import Reduce, one_process

# Shapes kept. The first 200 rows of 64K of an extension run (packed on CPU from a corpus of this machine's
# packages; dense_below 8K) hold 0-2 long documents each, the count changing 104 times from one row to the next:
# one graph would capture 104 times, these 3 times. Up to 8 long documents fit a row.
MAX_GRAPHS = 8


@dataclass
class _Captured:
    key: tuple  # the q/k shapes, scale, settings, reduce and the geometry's shapes (`_signature`)
    anchor: object  # the batch geometry last copied in: kept alive, and compared by identity
    rows: ProbeRows  # the graph's own copies of the batch geometry, overwritten for each batch
    geometries: tuple[LayoutGeometry, ...]
    graph: torch.cuda.CUDAGraph
    probe_BHQD: torch.Tensor  # inputs, overwritten before each replay
    k_BHkSD: torch.Tensor
    limits: FlexLimits
    pattern: Pattern  # outputs, overwritten by each replay
    arrays: list[LayoutArrays]


class PlanGraph:
    """The captured plans of the last MAX_GRAPHS shapes, least recently used first (the attention router owns
    one)."""

    def __init__(self):
        self.captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self.pool: tuple | None = None  # the graphs' shared memory pool, made with the first capture
        self.stream: torch.cuda.Stream | None = None  # their capture stream: the pool reuses blocks per stream
        self.keys_in: dict[tuple, torch.Tensor] = {}  # the graphs' shared key input by shape (a run has one)
        self.num_captures = 0
        self._signed: tuple[object, tuple] | None = None  # (anchor, its geometry's signature): once per batch

    def replay(
        self,
        probe_BHQD: torch.Tensor,
        k_BHkSD: torch.Tensor,
        rows: ProbeRows,
        geometries: tuple[LayoutGeometry, ...],
        anchor: object,
        scale: float,
        settings: AttentionConfig,
        limits: FlexLimits,
        reduce: Reduce = one_process,
        reduce_key: object = None,
    ) -> tuple[Pattern, list[LayoutArrays]]:
        """-> (pattern, one layout's arrays per geometry) of `estimate_from_probes(reduce(probe))` + `layout_arrays`,
        by replaying a captured graph.

        anchor: the object that owns rows and geometries for this batch (a new one: its geometry is copied in);
        limits: the layer's flex limits (an input; their width is part of the shapes); reduce_key: what identifies
        `reduce` (a ring's process group)."""
        if self._signed is None or self._signed[0] is not anchor:
            self._signed = (anchor, (_signature(rows), tuple(_signature(g) for g in geometries)))
        key = (
            probe_BHQD.shape,
            probe_BHQD.dtype,
            k_BHkSD.shape,
            k_BHkSD.dtype,
            k_BHkSD.device,
            scale,
            settings,
            limits.width,
            tuple(limits.keep_H.shape),
            reduce_key,
            *self._signed[1],
        )
        entry = self.captured.get(key)
        if entry is None:
            if len(self.captured) == MAX_GRAPHS:
                self.captured.popitem(last=False)
            if self.pool is None:
                self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
            k_shape = (k_BHkSD.shape, k_BHkSD.stride(), k_BHkSD.dtype, k_BHkSD.device)
            if k_shape not in self.keys_in:
                self.keys_in[k_shape] = torch.empty_like(k_BHkSD)  # as clone() would: the same strides
            k_in = self.keys_in[k_shape]
            k_in.copy_(k_BHkSD)  # the warm-up before the capture runs on this layer's keys
            entry = _capture(
                key, anchor, probe_BHQD, k_in, rows, geometries, scale, settings, limits, reduce, self.pool, self.stream
            )
            self.captured[key] = entry
            self.num_captures += 1
        else:  # the capture's inputs hold this layer's already
            self.captured.move_to_end(key)
            if entry.anchor is not anchor:
                _copy_into(entry.rows, rows)
                for mine, batch in zip(entry.geometries, geometries):
                    _copy_into(mine, batch)
                entry.anchor = anchor
            entry.probe_BHQD.copy_(probe_BHQD)
            entry.k_BHkSD.copy_(k_BHkSD)
            _copy_into(entry.limits, limits)
        entry.graph.replay()
        pattern = Pattern(*(t.clone() for t in dataclasses.astuple(entry.pattern)))
        return pattern, [LayoutArrays(*(t.clone() for t in arrays)) for arrays in entry.arrays]


def _signature(tree) -> tuple:
    """A dataclass of tensors (nested): its fields' shapes and dtypes, and its other fields' values."""
    out = []
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if isinstance(value, torch.Tensor):
            out.append((f.name, tuple(value.shape), value.dtype))
        elif dataclasses.is_dataclass(value):
            out.append((f.name, _signature(value)))
        else:
            out.append((f.name, value))
    return tuple(out)


def _clone(tree):
    """The dataclass with every tensor (nested) cloned: buffers a graph may read while the batch's own change."""
    changes = {}
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.clone()
        elif dataclasses.is_dataclass(value):
            changes[f.name] = _clone(value)
    return dataclasses.replace(tree, **changes)


def _copy_into(dst, src) -> None:
    """Copies every tensor of `src` into `dst`'s (same signature) on the current stream: no host sync."""
    for f in dataclasses.fields(dst):
        value = getattr(src, f.name)
        if isinstance(value, torch.Tensor):
            getattr(dst, f.name).copy_(value)
        elif dataclasses.is_dataclass(value):
            _copy_into(getattr(dst, f.name), value)


def planner(
    probe_in: torch.Tensor,
    k_in: torch.Tensor,
    rows_in: ProbeRows,
    geometries_in: tuple[LayoutGeometry, ...],
    scale: float,
    settings: AttentionConfig,
    limits_in: FlexLimits,
    reduce: Reduce,
) -> Callable[[], tuple[Pattern, list[LayoutArrays]]]:
    """What a graph captures: the plan from whatever its inputs hold when it runs, leaving them as they were."""

    def plan() -> tuple[Pattern, list[LayoutArrays]]:
        # a ring's reduce sums in place: reduce a copy, so that the warm-up leaves the input as it was
        probe_BHQD = probe_in if reduce is one_process else reduce(probe_in.clone())
        pattern = estimate_from_probes(probe_BHQD, k_in, rows_in, scale, settings, reduce, limits_in)
        return pattern, [layout_arrays(pattern, g) for g in geometries_in]

    return plan


def _capture(
    key: tuple,
    anchor: object,
    probe_BHQD: torch.Tensor,
    k_in: torch.Tensor,
    rows: ProbeRows,
    geometries: tuple[LayoutGeometry, ...],
    scale: float,
    settings: AttentionConfig,
    limits: FlexLimits,
    reduce: Reduce,
    pool: tuple,
    side: torch.cuda.Stream,
) -> _Captured:
    """k_in: the key input buffer (shared by the graphs of one key shape), already holding this layer's keys.
    pool, side: the memory pool and the side stream every capture of the PlanGraph shares (the caching allocator
    reuses a pool's freed blocks only on the stream that freed them)."""
    probe_in = probe_BHQD.clone()
    rows_in, geometries_in, limits_in = _clone(rows), tuple(_clone(g) for g in geometries), _clone(limits)
    plan = planner(probe_in, k_in, rows_in, geometries_in, scale, settings, limits_in, reduce)

    # Captured on a side stream with capture_begin/end rather than `torch.cuda.graph`, whose entry syncs the
    # device and empties the allocator's cache: once per batch, in the middle of a training step.
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        plan()  # warm-up outside the capture: kernel compiles, library handles
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # other threads (loggers) may use CUDA
        try:
            pattern, arrays = plan()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return _Captured(key, anchor, rows_in, geometries_in, graph, probe_in, k_in, limits_in, pattern, arrays)

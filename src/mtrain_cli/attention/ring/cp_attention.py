"""Context-parallel sparse attention for one layer: gather document ids → pattern estimation over the ring →
per-step block layouts → ring. What the attention router calls when `parallel.cp > 1`.

The pattern is estimated by the single-process estimator (attention/sparse/pattern.py: the Triton probe
kernels on GPU) on this rank's keys, with the partial statistics all_reduced over the ring. On a GPU the whole
plan (estimate, its all_reduces and the layouts of every chunk pair) is one CUDA graph replay
(sparse/plan_graph.py): eagerly it is ~800 small kernel launches, which keep the GPU waiting on the host.
Nothing in a plan reads the device from the host; what the plan computes (its work, its density) is counted
when read. The dense ring's plan depends on the batch alone: made once per batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import HostDocuments, document_spans
from mtrain_cli.attention.ring.ring import DIRECT, RingAttentionFunction, RingPlan, StepRunner
from mtrain_cli.attention.ring.ring_plan import ChunkPair, PairGeometry, step_geometries
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.engine import Engine
from mtrain_cli.attention.sparse.layout import layout_arrays, layout_from_arrays
from mtrain_cli.attention.sparse.pattern import (
    LIST_ALIGN,
    SENTINEL,
    FlexLimits,
    Pattern,
    ProbeRows,
    estimate_from_probes,
    probe_queries,
    probe_rows,
)
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.attention.sparse.probe_keys import ProbeKeys, Reduce, buffer_width, probe_keys
from mtrain_cli.parallel import RingTopology, TokenLayout


def dense_pattern(batch: int, heads: int, device: torch.device) -> Pattern:
    """The pattern of dense ring attention: no verticals, no slashes; with settings whose dense_below exceeds
    every document, every row runs dense over its causal range and nothing is probed."""
    # lists as wide as a sparse pattern's shortest (LIST_ALIGN): the kernels the sparse layers built serve it
    empty = torch.full((batch, heads, LIST_ALIGN), SENTINEL, dtype=torch.int32, device=device)
    diagonal = empty.clone()
    diagonal[..., 0] = 0
    return Pattern(empty, diagonal)


@functools.lru_cache(maxsize=64)
def rank_positions(token_layout: TokenLayout, rank: int, device: torch.device) -> torch.Tensor:
    """token_layout.positions(rank) on `device`, uploaded once instead of for every batch. Read-only: callers
    share it."""
    return token_layout.positions(rank).to(device)


@functools.lru_cache(maxsize=16)
def rank_probe_keys(token_layout: TokenLayout, rank: int, block: int, device: torch.device, pad: int) -> ProbeKeys:
    """A ring rank's ProbeKeys for R = pad probe rows a window. They depend on the layout, not the batch, and
    building them (host ops over the whole row, then uploads) sits on the first layer's plan. Their `widest` is
    the widest rank's buffer row (zigzag's middle rank holds one run of keys, the others two)."""
    widest = max(buffer_width(token_layout.positions(r), block, pad) for r in range(token_layout.world))
    return probe_keys(token_layout.positions(rank), token_layout.seq_len, block, pad, device, widest)


def ring_reduce(group: dist.ProcessGroup | None) -> Reduce:
    """Partial statistics combined over the ring's ranks (every rank gets the same result)."""

    def reduce(partial: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        partial = partial.contiguous()
        dist.all_reduce(partial, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return partial

    return reduce


def plan_density(plan: RingPlan, batch_heads: int, work: torch.Tensor) -> torch.Tensor:
    """Share of this rank's causal block pairs (over all ring steps) that `work`, the plan's active blocks
    (plan.work, or its bound plan.walked_blocks), covers; at most 1, as one process's density: the bound counts
    a vertical column apart from the ranges it may lie in, and passes the causal count where documents are short."""
    return (work / batch_heads / max(plan.causal_blocks(), 1)).clamp(max=1.0)


def gather_document_ids(doc_local_BS: torch.Tensor, token_layout: TokenLayout, group=None) -> torch.Tensor:
    """The whole row's document ids in global order, on every rank of the ring (all_gather of the shards)."""
    shards = [torch.empty_like(doc_local_BS) for _ in range(token_layout.world)]
    dist.all_gather(shards, doc_local_BS.contiguous(), group=group)
    doc_global_BS = torch.empty(
        doc_local_BS.shape[0], token_layout.seq_len, dtype=doc_local_BS.dtype, device=doc_local_BS.device
    )
    for rank, shard in enumerate(shards):
        doc_global_BS[:, rank_positions(token_layout, rank, doc_local_BS.device)] = shard
    return doc_global_BS


@dataclass(frozen=True)
class GlobalDocuments:
    """The batch's documents over the whole ring, the same on every rank."""

    doc_global_BS: torch.Tensor
    spans: tuple[torch.Tensor, torch.Tensor]  # each token's document start and length (document_spans)
    longest: int  # tokens of the longest document of the batch
    host: HostDocuments | None  # the same rows on the host, when the trainer gave them


def global_documents(
    doc_local_BS: torch.Tensor, token_layout: TokenLayout, topo: RingTopology, device: torch.device, cache: BatchCache
) -> GlobalDocuments:
    """Cached per batch: from the batch's HostDocuments (the trainer's: every rank has the whole rows), else one
    all_gather and one host read. Every rank sees the same sequence of batches and layers, and every rank's
    trainer adds the HostDocuments, so hits and misses (and the all_gather a miss makes) agree across ranks."""

    def build() -> GlobalDocuments:
        host = cache.host_documents(doc_local_BS)
        if host is not None and host.on_device is not None:
            assert host.shape == (doc_local_BS.shape[0], token_layout.seq_len), "the whole rows"
            doc_global_BS = host.on_device.to(device=device, dtype=torch.int32)
            return GlobalDocuments(doc_global_BS, document_spans(doc_global_BS), host.longest(), host)
        doc_global_BS = gather_document_ids(doc_local_BS.to(device=device, dtype=torch.int32), token_layout, topo.group)
        spans = document_spans(doc_global_BS)
        return GlobalDocuments(doc_global_BS, spans, int(spans[1].max()), None)

    return cache.per_batch(
        doc_local_BS, ("ring-documents", token_layout, topo.rank, id(topo.group), str(device)), build
    )


@dataclass(frozen=True)
class RingGeometry:
    """What this rank's ring plans need from the batch's documents alone: the same for every layer."""

    doc_global_BS: torch.Tensor
    rows: ProbeRows  # with this rank's keys
    pairs: list[tuple[int, PairGeometry]]  # (source rank, pair), by source
    doc_by_rank: list[torch.Tensor]


def ring_geometry(
    doc_local_BS: torch.Tensor,
    token_layout: TokenLayout,
    topo: RingTopology,
    settings: AttentionConfig,
    device: torch.device,
    cache: BatchCache,
) -> RingGeometry:
    """Cached per batch, as global_documents."""

    def build() -> RingGeometry:
        documents = global_documents(doc_local_BS, token_layout, topo, device, cache)
        doc_global_BS = documents.doc_global_BS
        positions_S = rank_positions(token_layout, topo.rank, device)
        start_BS, length_BS = documents.spans
        doc_by_rank = [doc_global_BS[:, rank_positions(token_layout, r, device)] for r in range(token_layout.world)]
        pairs = [
            (source, pair)
            for source in range(token_layout.world)
            for pair in step_geometries(
                token_layout,
                topo.rank,
                source,
                doc_by_rank[topo.rank],
                doc_by_rank[source],
                start_BS[:, positions_S],
                length_BS[:, positions_S],
                settings.dense_below,
            )
        ]
        keys_for = functools.partial(rank_probe_keys, token_layout, topo.rank, settings.block_size, device)
        most_long = documents.host.most_long(settings.dense_below) if documents.host is not None else None
        rows = probe_rows(doc_global_BS, settings, documents.spans, keys_for, most_long)
        return RingGeometry(doc_global_BS, rows, pairs, doc_by_rank)

    return cache.per_batch(
        doc_local_BS, ("ring", token_layout, topo.rank, id(topo.group), settings, str(device)), build
    )


@torch.no_grad()  # the plan is data: recorded, it would also make a checkpoint recompute save fewer tensors
def plan_ring(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    doc_local_BS: torch.Tensor,
    token_layout: TokenLayout,
    topo: RingTopology,
    scale: float,
    settings: AttentionConfig | None,
    engine: Engine,
    cache: BatchCache,
    graph: PlanGraph | None = None,
    limits: FlexLimits | None = None,
) -> tuple[RingPlan, Pattern | None]:
    """Estimate the pattern together and lay out every (rank, source) pair for this rank; None settings: the dense
    ring's plan (plan_dense_ring) and no pattern. graph: replay the plan as a CUDA graph (on a GPU; None: eager);
    limits: the flex rule's per head (None: the settings'), the same on every rank."""
    if settings is None:
        B, H = q_BHSD.shape[:2]
        plan = plan_dense_ring(doc_local_BS, token_layout, topo, (B, H), scale, engine, q_BHSD.device, cache)
        return plan, None
    geo = ring_geometry(doc_local_BS, token_layout, topo, settings, q_BHSD.device, cache)
    probe_BHQD = probe_queries(q_BHSD, geo.rows)  # zero where another rank holds the query: the reduce sums
    reduce = ring_reduce(topo.group)
    geometries = tuple(pair.geometry for _, pair in geo.pairs)
    if limits is None:
        limits = FlexLimits.fixed(settings, q_BHSD.shape[1], q_BHSD.device)
    if graph is not None and q_BHSD.is_cuda:
        pattern, arrays = graph.replay(
            probe_BHQD, k_BHkSD, geo.rows, geometries, geo, scale, settings, limits, reduce, reduce_key=id(topo.group)
        )
    else:
        pattern = estimate_from_probes(reduce(probe_BHQD), k_BHkSD, geo.rows, scale, settings, reduce, limits)
        arrays = [layout_arrays(pattern, g) for g in geometries]
    return _ring_plan(geo, arrays, topo, scale, engine), pattern


def plan_dense_ring(
    doc_local_BS: torch.Tensor,
    token_layout: TokenLayout,
    topo: RingTopology,
    batch_heads: tuple[int, int],
    scale: float,
    engine: Engine,
    device: torch.device,
    cache: BatchCache,
) -> RingPlan:
    """The dense ring's plan (every row over its causal range of its document): the same for every layer of a
    batch, so made once per batch. batch_heads: (B, H) of the queries."""

    def build() -> RingPlan:
        settings = AttentionConfig(block_size=token_layout.block, dense_below=2**62)
        geo = ring_geometry(doc_local_BS, token_layout, topo, settings, device, cache)
        pattern = dense_pattern(*batch_heads, device)
        return _ring_plan(geo, [layout_arrays(pattern, pair.geometry) for _, pair in geo.pairs], topo, scale, engine)

    key = ("ring-dense", token_layout, topo.rank, id(topo.group), str(device), batch_heads, scale, engine)
    return cache.per_batch(doc_local_BS, key, build)


def _ring_plan(geo: RingGeometry, arrays: list, topo: RingTopology, scale: float, engine: Engine) -> RingPlan:
    pairs: dict[int, list[ChunkPair]] = {source: [] for source, _ in geo.pairs}
    for (source, g), layout_arrays_ in zip(geo.pairs, arrays):
        pairs[source].append(
            ChunkPair(g.q_slice, g.k_slice, layout_from_arrays(g.geometry, layout_arrays_), g.mask_bounds, g.plain)
        )
    return RingPlan(pairs, geo.doc_by_rank[topo.rank], geo.doc_by_rank, scale, engine)


def ring_attention(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    plan: RingPlan,
    topo: RingTopology,
    run_step: StepRunner = DIRECT,
) -> torch.Tensor:
    """-> this rank's output [B, H, S_local, D], differentiable in its q, k, v. `run_step`: see StepRunner."""
    return RingAttentionFunction.apply(
        q_BHSD.contiguous(), k_BHkSD.contiguous(), v_BHkSD.contiguous(), plan, topo, run_step
    )

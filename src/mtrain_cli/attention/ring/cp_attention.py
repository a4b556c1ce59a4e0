"""Context-parallel sparse attention for one layer: gather document ids → pattern estimation over the ring →
per-step block layouts → ring. What the attention router calls when `parallel.cp > 1`.

The pattern is estimated by the single-process estimator (attention/sparse/pattern.py: the Triton probe
kernels on GPU) on this rank's keys, with the partial statistics all_reduced over the ring. It runs eagerly:
the one-process plan's CUDA graph (plan_graph.py) holds no collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring.ring import DIRECT, RingAttentionFunction, RingPlan, StepRunner
from mtrain_cli.attention.ring.ring_plan import PairGeometry, pairs_from_geometry, step_geometries
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.engine import Engine
from mtrain_cli.attention.sparse.pattern import (
    SENTINEL,
    Pattern,
    ProbeRows,
    estimate_pattern,
    probe_rows,
)
from mtrain_cli.attention.sparse.probe_keys import Reduce
from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.topology import RingTopology


def dense_pattern(batch: int, heads: int, device: torch.device) -> Pattern:
    """The pattern of dense ring attention: no verticals, no slashes; with settings whose dense_below exceeds
    every document, every row runs dense over its causal range and nothing is probed."""
    empty = torch.full((batch, heads, 1), SENTINEL, dtype=torch.int32, device=device)
    return Pattern(empty, torch.zeros(batch, heads, 1, dtype=torch.int32, device=device))


def ring_reduce(group: dist.ProcessGroup | None) -> Reduce:
    """Partial statistics combined over the ring's ranks (every rank gets the same result)."""

    def reduce(partial: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
        partial = partial.contiguous()
        dist.all_reduce(partial, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return partial

    return reduce


def plan_density(plan: RingPlan, batch_heads: int) -> float:
    """Share of this rank's causal block pairs (over all ring steps) that its layouts compute."""
    return sum(plan.work_by_source.values()) / batch_heads / max(plan.causal_blocks, 1)


def gather_document_ids(doc_local_BS: torch.Tensor, token_layout: TokenLayout, group=None) -> torch.Tensor:
    """The whole row's document ids in global order, on every rank of the ring (all_gather of the shards)."""
    shards = [torch.empty_like(doc_local_BS) for _ in range(token_layout.world)]
    dist.all_gather(shards, doc_local_BS.contiguous(), group=group)
    doc_global_BS = torch.empty(
        doc_local_BS.shape[0], token_layout.seq_len, dtype=doc_local_BS.dtype, device=doc_local_BS.device
    )
    for rank, shard in enumerate(shards):
        doc_global_BS[:, token_layout.positions(rank).to(doc_local_BS.device)] = shard
    return doc_global_BS


@dataclass(frozen=True)
class RingGeometry:
    """What this rank's ring plans need from the batch's documents alone: the same for every layer."""

    doc_global_BS: torch.Tensor
    rows: ProbeRows  # with this rank's keys
    pairs: dict[int, list[PairGeometry]]  # by source rank
    doc_by_rank: list[torch.Tensor]


def ring_geometry(
    doc_local_BS: torch.Tensor,
    token_layout: TokenLayout,
    topo: RingTopology,
    settings: AttentionConfig,
    device: torch.device,
    cache: BatchCache,
) -> RingGeometry:
    """Cached per batch. Every rank sees the same sequence of batches and layers, so hits and misses (and
    the all_gather a miss makes) agree across ranks."""

    def build() -> RingGeometry:
        doc_global_BS = gather_document_ids(doc_local_BS.to(device=device, dtype=torch.int32), token_layout, topo.group)
        positions_S = token_layout.positions(topo.rank).to(device)
        spans = document_spans(doc_global_BS)
        start_BS, length_BS = spans
        doc_by_rank = [doc_global_BS[:, token_layout.positions(r).to(device)] for r in range(token_layout.world)]
        pairs = {
            source: step_geometries(
                token_layout,
                topo.rank,
                source,
                doc_by_rank[topo.rank],
                doc_by_rank[source],
                start_BS[:, positions_S],
                length_BS[:, positions_S],
                settings.dense_below,
            )
            for source in range(token_layout.world)
        }
        rows = probe_rows(doc_global_BS, settings, spans, token_layout.positions(topo.rank))
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
    settings: AttentionConfig,
    engine: Engine,
    cache: BatchCache,
    pattern: Pattern | None = None,
) -> tuple[RingPlan, Pattern]:
    """Estimate the pattern together (unless given) and lay out every (rank, source) pair for this rank."""
    geo = ring_geometry(doc_local_BS, token_layout, topo, settings, q_BHSD.device, cache)
    if pattern is None:
        pattern = estimate_pattern(
            q_BHSD, k_BHkSD, geo.doc_global_BS, scale, settings, geo.rows, ring_reduce(topo.group)
        )
    pairs = {source: pairs_from_geometry(pattern, geometries) for source, geometries in geo.pairs.items()}
    work = {
        source: float(sum(p.layout.active_blocks().sum() for p in chunk_pairs)) for source, chunk_pairs in pairs.items()
    }
    causal = sum(p.layout.causal_blocks() for chunk_pairs in pairs.values() for p in chunk_pairs)
    return RingPlan(pairs, geo.doc_by_rank[topo.rank], geo.doc_by_rank, scale, engine, work, causal), pattern


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

"""Dynamic sparse attention as one differentiable op: estimate the pattern → block layout → kernels.

`plan_sparse` estimates a vertical-slash pattern from q/k and turns it into a `BlockLayout` (on a GPU by
replaying one CUDA graph per batch, plan_graph.py);
`sparse_attention_with_layout` runs the Triton kernels (CUDA, or the Triton interpreter) or the plain-torch
reference (CPU) on it, forward and backward. The layout is computed once per forward and saved for
backward; the caller may cache it across an activation-checkpoint recompute (see attention/router.py). What
is per batch (the geometry, the captured plan, the kernels' tile mask bounds) lives in the caller's `BatchCache`
and `PlanGraph`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.engine import Engine
from mtrain_cli.attention.sparse.kernels import kernel_layout, tile_mask_bounds
from mtrain_cli.attention.sparse.kernels_bwd import sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.sparse.layout import (
    BlockLayout,
    LayoutGeometry,
    layout_arrays,
    layout_from_arrays,
    layout_geometry,
)
from mtrain_cli.attention.sparse.pattern import (
    FlexLimits,
    ProbeRows,
    estimate_from_probes,
    probe_queries,
    probe_rows,
)
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.attention.sparse.reference import reference_attention


@dataclass(frozen=True)
class SparsePlan:
    layout: BlockLayout
    document_ids_BS: torch.Tensor  # int32
    recall_BH: torch.Tensor  # share of the probe rows' attention mass the layout computes
    visible_blocks: torch.Tensor  # 0-dim: block pairs a row may see (causal, own document), mean over rows
    chosen_BH: torch.Tensor  # verticals or slashes chosen beyond the forced ones, the larger (Pattern.chosen_BH)

    @functools.cached_property
    def density(self) -> torch.Tensor:
        """Share of the causal block triangle computed (0-dim): accounting for logs, made when first asked,
        not part of the plan the kernels need."""
        return self.layout.density()

    @functools.cached_property
    def work_share(self) -> torch.Tensor:
        """Share of dense attention's work computed (0-dim): dense attention computes every block a row may
        see, so packed documents' cross-document blocks count in neither. FLOP accounting, made when asked."""
        return (self.layout.active_blocks().mean() / self.visible_blocks).clamp(max=1.0)

    @functools.cached_property
    def _work_split(self) -> torch.Tensor:
        return work_split(self.layout, self.visible_blocks)

    def work_split_bound(self) -> torch.Tensor:
        """[range, vertical, visible] (see `work_split`), from the row ranges alone: a few kernels, no host
        sync; made once per plan (both bounds below read it)."""
        return self._work_split

    def work_share_bound(self) -> torch.Tensor:
        """An upper bound of `work_share`: cheap enough to account every layer of a training step."""
        return self.work_split_bound()[:2].sum().clamp(max=1.0)

    def density_bound(self) -> torch.Tensor:
        """An upper bound of `density`, as cheap (training logs it every step for every layer)."""
        range_share, vertical_share, visible_share = self.work_split_bound().unbind()
        return ((range_share + vertical_share) * visible_share).clamp(max=1.0)


def work_split(layout: BlockLayout, visible_blocks: torch.Tensor) -> torch.Tensor:
    """fp32 [3]: the block pairs the kernels walk as tiles (slash and dense ranges) and the vertical columns they
    gather (in blocks; columns inside slash blocks too, which the kernels load and mask), mean over (B, H), each
    over `visible_blocks` (dense attention's work); then dense attention's work over the causal triangle (1 for
    one document per row, about 1/n for n packed documents). Each prices differently (attention/crossover.py)."""
    B, H = layout.row_BHM6.shape[:2]
    ranges_verticals = layout.walked_blocks().float() / (B * H)
    causal_share = visible_blocks / max(layout.causal_blocks(), 1)
    return torch.cat([ranges_verticals / visible_blocks, causal_share[None]])


@dataclass(frozen=True)
class BatchDocuments:
    """A batch's documents, what every plan of its forward starts from: the same for all its layers."""

    document_ids_BS: torch.Tensor  # int32, contiguous
    start_BS: torch.Tensor  # each token's document start and length (pattern.document_spans)
    length_BS: torch.Tensor
    longest: int  # tokens of the batch's longest document, read on the host once per batch


def batch_documents(
    document_ids_BS: torch.Tensor | None, B: int, S: int, device: torch.device, cache: BatchCache
) -> BatchDocuments:
    """None ids: one document per row, of S tokens (nothing to read)."""

    def build() -> BatchDocuments:
        if document_ids_BS is None:
            ids_BS = torch.zeros(B, S, dtype=torch.int32, device=device)
        else:
            ids_BS = document_ids_BS.to(device=device, dtype=torch.int32).contiguous()
        start_BS, length_BS = document_spans(ids_BS)
        host = cache.host_rows(document_ids_BS)
        if document_ids_BS is None:
            longest = S
        elif host is not None:
            longest = host.longest()
        else:
            longest = int(length_BS.max())
        return BatchDocuments(ids_BS, start_BS, length_BS, longest)

    return cache.per_batch(document_ids_BS, ("documents", B, S, str(device)), build)


@dataclass(frozen=True)
class BatchGeometry:
    """What a plan needs from the batch's documents alone: the same for every layer of a forward."""

    document_ids_BS: torch.Tensor  # int32, contiguous
    rows: ProbeRows
    layout: LayoutGeometry
    visible_blocks: torch.Tensor  # 0-dim float: mean over rows of the (query, key) block pairs a row may see


def visible_blocks(doc_start_BS: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over rows of the block pairs dense document-causal attention computes: query block i sees key
    blocks from its first query's document start to i (0-dim float)."""
    first_q_M = torch.arange(0, doc_start_BS.shape[1], block, device=doc_start_BS.device)
    seen_BM = first_q_M // block - doc_start_BS[:, first_q_M] // block + 1
    return seen_BM.sum(1).float().mean()


def batch_geometry(
    document_ids_BS: torch.Tensor | None,
    B: int,
    S: int,
    device: torch.device,
    settings: AttentionConfig,
    cache: BatchCache,
) -> BatchGeometry:
    def build() -> BatchGeometry:
        documents = batch_documents(document_ids_BS, B, S, device, cache)
        spans = documents.start_BS, documents.length_BS
        host = cache.host_rows(document_ids_BS)
        most_long = host.most_long(settings.dense_below) if host is not None else None
        return BatchGeometry(
            documents.document_ids_BS,
            probe_rows(documents.document_ids_BS, settings, spans, most_long=most_long),
            layout_geometry(*spans, S, settings.block_size, settings.dense_below),
            visible_blocks(documents.start_BS, settings.block_size),
        )

    return cache.per_batch(document_ids_BS, ("plan", B, S, str(device), settings), build)


@torch.no_grad()
def plan_sparse(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    document_ids_BS: torch.Tensor | None,
    scale: float,
    settings: AttentionConfig,
    cache: BatchCache,
    graph: PlanGraph,
    limits: FlexLimits | None = None,
) -> SparsePlan:
    """Pattern estimation and block layout for self-attention over one packed sequence batch. limits: the flex
    rule's per head (None: the settings' p and cap)."""
    B, H, S, _ = q_BHSD.shape
    geometry = batch_geometry(document_ids_BS, B, S, q_BHSD.device, settings, cache)
    probe_BHQD = probe_queries(q_BHSD, geometry.rows)
    if limits is None:
        limits = FlexLimits.fixed(settings, H, q_BHSD.device)
    if q_BHSD.is_cuda:  # one captured graph per batch, replayed by every layer (see plan_graph.py)
        pattern, (arrays,) = graph.replay(
            probe_BHQD, k_BHkSD, geometry.rows, (geometry.layout,), geometry, scale, settings, limits
        )
    else:
        pattern = estimate_from_probes(probe_BHQD, k_BHkSD, geometry.rows, scale, settings, limits=limits)
        arrays = layout_arrays(pattern, geometry.layout)
    return SparsePlan(
        layout_from_arrays(geometry.layout, arrays),
        geometry.document_ids_BS,
        pattern.recall_BH,
        geometry.visible_blocks,
        pattern.chosen_BH,
    )


class SparseAttentionFunction(torch.autograd.Function):
    """Triton forward/backward; the layout is fixed data, saved from forward for backward. The kernels' tile
    mask bounds depend on the document ids alone: made once per batch and shared by every layer's passes."""

    @staticmethod
    def forward(
        ctx, q_BHSD, k_BHkSD, v_BHkSD, layout: BlockLayout, doc_BS: torch.Tensor, scale: float, cache: BatchCache
    ):
        bounds = cache.per_batch(
            doc_BS,
            ("tile_mask_bounds", layout.block, layout.mask_shift),
            lambda: tile_mask_bounds(doc_BS, doc_BS, layout.block, layout.mask_shift),
        )
        out_BHSD, lse_BHS = sparse_forward(q_BHSD, k_BHkSD, v_BHkSD, layout, doc_BS, doc_BS, scale, mask_bounds=bounds)
        ctx.save_for_backward(q_BHSD, k_BHkSD, v_BHkSD, out_BHSD, lse_BHS, doc_BS)
        ctx.layout, ctx.scale, ctx.mask_bounds = layout, scale, bounds
        return out_BHSD

    @staticmethod
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BHkSD, v_BHkSD, out_BHSD, lse_BHS, doc_BS = ctx.saved_tensors
        dq, dk, dv = sparse_backward(
            q_BHSD,
            k_BHkSD,
            v_BHkSD,
            out_BHSD,
            lse_BHS,
            dout_BHSD,
            ctx.layout,
            doc_BS,
            doc_BS,
            ctx.scale,
            mask_bounds=ctx.mask_bounds,
        )
        return dq, dk, dv, None, None, None, None


def sparse_attention_with_layout(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    plan: SparsePlan,
    scale: float,
    engine: Engine,
    cache: BatchCache,
) -> torch.Tensor:
    """-> out [B, H, S, D] in q's dtype. GQA: H must be a multiple of K/V heads (K/V are never repeated)."""
    if engine == "reference":
        out_BHSD, _ = reference_attention(
            q_BHSD,
            k_BHkSD,
            v_BHkSD,
            plan.layout,
            plan.document_ids_BS,
            plan.document_ids_BS,
            scale,
            compute_dtype=torch.float32,
        )
        return out_BHSD.to(q_BHSD.dtype)
    return SparseAttentionFunction.apply(
        *(kernel_layout(t) for t in (q_BHSD, k_BHkSD, v_BHkSD)), plan.layout, plan.document_ids_BS, scale, cache
    )

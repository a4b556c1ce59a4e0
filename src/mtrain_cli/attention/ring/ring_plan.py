"""What each rank computes at each ring step: (query slice, key slice, block layout) pairs.

At step s of a flat ring, rank r holds the K/V of rank (r - s) mod W. Under the stripe layout both sides
are block-strided chunks (local block m = global block W·m + rank), so one strided layout covers the pair.
Under zigzag each rank holds two contiguous chunks, giving up to four contiguous pairs (pairs entirely in
the future are skipped). Layouts are built from the one global pattern, so every rank sees the same
vertical/slash choice and the union over steps equals the single-process layout.

A zigzag pair is *plain* when, in every batch row, its queries and keys all lie in one document (one run of
document ids) shorter than dense_below: its rows run dense, so its mask is all-visible (key chunk before the
query chunk) or causal (the same chunk), and a library kernel runs it (ring/plain_pairs.py). Stripe pairs are
block-strided, never plain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mtrain_cli.attention.sparse.kernels import MaskBounds, tile_mask_bounds
from mtrain_cli.attention.sparse.layout import BlockLayout, LayoutGeometry, layout_from_geometry, layout_geometry
from mtrain_cli.attention.sparse.pattern import Pattern
from mtrain_cli.parallel import TokenLayout

PlainMask = Literal["full", "causal"]


@dataclass(frozen=True)
class ChunkPair:
    q_slice: slice  # of the rank's local queries
    k_slice: slice  # of the K/V chunk held at this step
    layout: BlockLayout
    mask_bounds: MaskBounds
    plain: PlainMask | None = None  # a plain pair's mask (a library kernel runs it); None: cut, our kernels


@dataclass(frozen=True)
class PairGeometry:
    """A chunk pair before the pattern: its slices, the pattern-independent half of its layout, and the
    kernels' tile mask bounds (made here once per batch, not by each layer's chunk calls: ~30 small ops each)."""

    q_slice: slice
    k_slice: slice
    geometry: LayoutGeometry
    mask_bounds: MaskBounds
    plain: PlainMask | None = None  # as ChunkPair.plain


def _pair(
    q_slice: slice,
    k_slice: slice,
    geometry: LayoutGeometry,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    plain: PlainMask | None = None,
) -> PairGeometry:
    bounds = tile_mask_bounds(
        doc_q_BSq[:, q_slice].to(torch.int32),
        doc_k_BSk[:, k_slice].to(torch.int32),
        geometry.block,
        geometry.mask_shift,
    )
    return PairGeometry(q_slice, k_slice, geometry, bounds, plain)


def _plain_in_every_row(
    doc_start_BSq: torch.Tensor, doc_length_BSq: torch.Tensor, k_start: int, k_end: int, dense_below: int
) -> torch.Tensor:
    """0-dim bool: in every row these queries share one document, it holds the keys [k_start, k_end) (global
    positions) and it is shorter than dense_below (its rows run dense)."""
    start_B, length_B = doc_start_BSq[:, 0], doc_length_BSq[:, 0]
    one_document_B = (doc_start_BSq == start_B[:, None]).all(1)
    holds_keys_B = (start_B <= k_start) & (k_end <= start_B + length_B)
    return (one_document_B & holds_keys_B & (length_B < dense_below)).all()


def step_geometries(
    token_layout: TokenLayout,
    rank: int,
    source: int,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    doc_start_BSq: torch.Tensor,
    doc_length_BSq: torch.Tensor,
    dense_below: int,
) -> list[PairGeometry]:
    """Pairs for rank `rank` attending to the K/V of rank `source`, without a pattern (one per batch).

    doc_q_BSq / doc_k_BSk: the document ids of this rank's queries and of the source's keys;
    doc_start_BSq / doc_length_BSq: the global start and length of each local query's document."""
    block, world = token_layout.block, token_layout.world
    if token_layout.kind == "stripe":
        geometry = layout_geometry(
            doc_start_BSq,
            doc_length_BSq,
            token_layout.local_len,
            block,
            dense_below,
            q_offset=rank * block,
            k_offset=source * block,
            stride=world,
        )
        return [_pair(slice(None), slice(None), geometry, doc_q_BSq, doc_k_BSk)]
    chunk = token_layout.local_len // 2
    q_chunks, k_chunks = (rank, 2 * world - 1 - rank), (source, 2 * world - 1 - source)
    candidates = []  # (query rows, key slice, global query chunk, global key chunk)
    for a, cq in enumerate(q_chunks):
        for b, ck in enumerate(k_chunks):
            if ck <= cq:  # else entirely in the future
                candidates.append((slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk), cq, ck))
    plain_checks = [
        _plain_in_every_row(doc_start_BSq[:, rows], doc_length_BSq[:, rows], ck * chunk, (ck + 1) * chunk, dense_below)
        for rows, _, _, ck in candidates
    ]
    plain_flags = torch.stack(plain_checks).tolist()  # one host read per (rank, source), once per batch
    pairs = []
    for (rows, keys, cq, ck), plain in zip(candidates, plain_flags):
        geometry = layout_geometry(
            doc_start_BSq[:, rows],
            doc_length_BSq[:, rows],
            chunk,
            block,
            dense_below,
            q_offset=cq * chunk,
            k_offset=ck * chunk,
        )
        mask = ("causal" if cq == ck else "full") if plain else None
        pairs.append(_pair(rows, keys, geometry, doc_q_BSq, doc_k_BSk, mask))
    return pairs


def pairs_from_geometry(pattern: Pattern, geometries: list[PairGeometry]) -> list[ChunkPair]:
    return [
        ChunkPair(g.q_slice, g.k_slice, layout_from_geometry(pattern, g.geometry), g.mask_bounds, g.plain)
        for g in geometries
    ]


def step_pairs(
    pattern: Pattern,
    token_layout: TokenLayout,
    rank: int,
    source: int,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    doc_start_BSq: torch.Tensor,
    doc_length_BSq: torch.Tensor,
    dense_below: int,
) -> list[ChunkPair]:
    """Pairs for rank `rank` attending to the K/V of rank `source` (`step_geometries` + the pattern)."""
    return pairs_from_geometry(
        pattern,
        step_geometries(token_layout, rank, source, doc_q_BSq, doc_k_BSk, doc_start_BSq, doc_length_BSq, dense_below),
    )

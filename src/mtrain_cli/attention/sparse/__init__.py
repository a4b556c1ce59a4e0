"""Dynamic vertical-slash sparse attention in one process: pattern estimation from probe queries (pattern.py),
the block layout (layout.py), the Triton kernels (forward with LSE, a column-parallel backward without atomics)
and the plain-torch reference that the tests hold them to. The public face, for the ring, profile/ and bench/.
Importing it loads Triton."""

from __future__ import annotations

from typing import Any

from mtrain_cli.attention.sparse import kernels_bwd, kernels_dkdv, kernels_fwd, kernels_vertical
from mtrain_cli.attention.sparse.engine import Engine, default_engine
from mtrain_cli.attention.sparse.kernels import MaskBounds, tile_mask_bounds
from mtrain_cli.attention.sparse.kernels_bwd import attention_delta, sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.sparse.layout import BlockLayout, HostCopy, build_layout
from mtrain_cli.attention.sparse.ops import (
    SparseAttentionFunction,
    SparsePlan,
    batch_geometry,
    plan_sparse,
    sparse_attention_with_layout,
    visible_blocks,
    work_split,
)
from mtrain_cli.attention.sparse.pattern import (
    PROBE_BUFFER_BYTES,
    SENTINEL,
    Pattern,
    estimate_pattern,
    head_group,
    slash_block_offsets,
)
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.attention.sparse.prebuild import KernelShape, Prebuild, start_prebuild
from mtrain_cli.attention.sparse.reference import reference_attention


def autotuned_kernels() -> dict[str, Any]:
    """The autotuned Triton kernels by name (a profile records the config each one chose)."""
    return {
        "forward": kernels_fwd._forward_kernel,
        "dq": kernels_bwd._dq_kernel,
        "dkdv": kernels_dkdv._dkdv_kernel,
        "vertical": kernels_vertical._vertical_kernel,
    }


__all__ = [
    "PROBE_BUFFER_BYTES",
    "SENTINEL",
    "BlockLayout",
    "Engine",
    "HostCopy",
    "KernelShape",
    "MaskBounds",
    "Pattern",
    "PlanGraph",
    "Prebuild",
    "SparseAttentionFunction",
    "SparsePlan",
    "attention_delta",
    "autotuned_kernels",
    "batch_geometry",
    "build_layout",
    "default_engine",
    "estimate_pattern",
    "head_group",
    "plan_sparse",
    "reference_attention",
    "slash_block_offsets",
    "sparse_attention_with_layout",
    "sparse_backward",
    "sparse_forward",
    "start_prebuild",
    "tile_mask_bounds",
    "visible_blocks",
    "work_split",
]

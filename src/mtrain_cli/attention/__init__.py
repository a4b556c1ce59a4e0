"""Attention for HF models, unaware of distribution: dense over packed documents, dynamic vertical-slash sparse
(sparse/), and ring attention over context-parallel ranks (ring/), chosen per call by the router that the trainer
or eval enters around the forward (router.py); models reach it through one registered attention function
(hook.py).

This is the package's public face; other packages import from here (or from the `sparse` and `ring` faces), and
`settings` directly, which config reads before torch loads. Names resolve on first use: importing the face costs
nothing, and dense attention never loads Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AttentionConfig": "settings",
    "ATTENTION_NAME": "hook",
    "compute_dtype": "hook",
    "mtrain_attention": "hook",
    "register_attention": "hook",
    "LayerObservation": "recall_control",
    "RecallController": "recall_control",
    "layer_observations": "recall_control",
    "AttentionRouter": "router",
    "PLAN_RANGE": "router",
    "CallPath": "records",
    "PendingStats": "records",
    "Route": "records",
    "SPARSE_PATHS": "records",
    "BatchCache": "batch_cache",
    "dense_attention": "dense",
    "document_spans": "documents",
    "CostRule": "crossover",
    "CrossoverPolicy": "crossover",
    "MEASURED_BLOCK": "crossover",
    "MEASURED_HEADS": "crossover",
    "SparseCost": "crossover",
    "crossover_rule": "crossover",
}
__all__ = [  # noqa: RUF022 (the order of _EXPORTS: by module)
    "AttentionConfig",
    "ATTENTION_NAME",
    "compute_dtype",
    "mtrain_attention",
    "register_attention",
    "LayerObservation",
    "RecallController",
    "layer_observations",
    "AttentionRouter",
    "PLAN_RANGE",
    "CallPath",
    "PendingStats",
    "Route",
    "SPARSE_PATHS",
    "BatchCache",
    "dense_attention",
    "document_spans",
    "CostRule",
    "CrossoverPolicy",
    "MEASURED_BLOCK",
    "MEASURED_HEADS",
    "SparseCost",
    "crossover_rule",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


if TYPE_CHECKING:
    from mtrain_cli.attention.batch_cache import BatchCache
    from mtrain_cli.attention.crossover import (
        MEASURED_BLOCK,
        MEASURED_HEADS,
        CostRule,
        CrossoverPolicy,
        SparseCost,
        crossover_rule,
    )
    from mtrain_cli.attention.dense import dense_attention
    from mtrain_cli.attention.documents import document_spans
    from mtrain_cli.attention.hook import ATTENTION_NAME, compute_dtype, mtrain_attention, register_attention
    from mtrain_cli.attention.recall_control import LayerObservation, RecallController, layer_observations
    from mtrain_cli.attention.records import SPARSE_PATHS, CallPath, PendingStats, Route
    from mtrain_cli.attention.router import PLAN_RANGE, AttentionRouter
    from mtrain_cli.attention.settings import AttentionConfig

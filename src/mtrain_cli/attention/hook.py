"""The one attention function mtrain registers with transformers' `AttentionInterface`.

HF models call it in place of SDPA/flash for every layer; the model code stays single-device and
unpatched. Packed batches pass `document_ids` [B, S] through the model's forward kwargs; the mask is
built here from them (transformers builds no mask for us: our mask function returns None).

What runs is set once per process with `configure_attention` (dense SDPA, or dynamic sparse attention with
its settings). Every call is counted by path, so a run's summary states which attention actually ran.
Inside `plan_cache()` (one micro-batch's forward and backward), each layer's sparse plan is computed once
and reused when activation checkpointing re-runs that layer's forward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from mtrain_cli.attention.dense import dense_attention
from mtrain_cli.attention.sparse.ops import (Backend, SparsePlan, default_backend, plan_sparse,
                                             sparse_attention_with_layout)
from mtrain_cli.attention.sparse.pattern import SparseSettings
from mtrain_cli.parallel.cp_attention import dense_pattern, plan_density, plan_ring, ring_attention
from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.ring import RingTopology

ATTENTION_NAME = "mtrain"


@dataclass(frozen=True)
class ContextParallel:
    """Attention over a ring of context-parallel ranks: each holds its `layout` share of every sequence."""
    topology: RingTopology
    layout: str  # "stripe" or "zigzag"
    block: int


@dataclass
class _Routing:
    sparse: SparseSettings | None = None  # None: dense
    backend: Backend | None = None  # None: by device
    cp: ContextParallel | None = None  # None: the whole sequence is in this process
    calls_by_path: Counter[str] = field(default_factory=Counter)
    plans: dict | None = None  # the active plan cache, keyed by attention module
    recall: list[torch.Tensor] = field(default_factory=list)  # per fresh plan, kept on device until read
    density: list[SparsePlan | torch.Tensor] = field(default_factory=list)  # plans: density computed when read
    ring_work: float = 0.0  # active blocks this rank's ring plans compute (for the cp imbalance)


_routing = _Routing()


def sparse_settings(attention) -> SparseSettings | None:
    """The recipe's `attention` section (config.AttentionConfig) as kernel-side settings; None when dense."""
    if attention.mode == "dense":
        return None
    return SparseSettings(selection=attention.pattern, p=attention.p, cap=attention.cap,
                          num_vertical=attention.num_vertical, num_slash=attention.num_slash, last_q=attention.last_q,
                          block_size=attention.block_size, num_sink=attention.num_sink,
                          local_window=attention.local_window, dense_below=attention.dense_below,
                          max_probe_rows=attention.max_probe_rows)


def configure_attention(sparse: SparseSettings | None, backend: Backend | None = None,
                        cp: ContextParallel | None = None) -> None:
    """Dense attention (sparse=None) or dynamic sparse attention with these settings, for every layer; over a
    context-parallel ring when `cp` is given (dense then means the dense ring)."""
    _routing.sparse, _routing.backend, _routing.cp = sparse, backend, cp


@contextlib.contextmanager
def plan_cache():
    """Reuse each layer's sparse plan inside this scope (forward, then the recompute during backward)."""
    previous, _routing.plans = _routing.plans, {}
    try:
        yield
    finally:
        _routing.plans = previous


def _plan(module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> SparsePlan:
    cache = _routing.plans
    if cache is not None and id(module) in cache:
        plan = cache[id(module)]
        assert plan.layout.q_len == q_BHSD.shape[2], "a cached plan must serve the same sequence"
        _routing.calls_by_path["sparse-plan-reused"] += 1
        return plan
    plan = plan_sparse(q_BHSD, k_BHkSD, document_ids, scale, _routing.sparse)
    _routing.recall.append(plan.recall_BH.mean())
    _routing.density.append(plan)
    if cache is not None:
        cache[id(module)] = plan
    return plan


def _ring(module: torch.nn.Module, q_BHSD, k_BHkSD, v_BHkSD, document_ids, scale) -> torch.Tensor:
    cp = _routing.cp
    assert document_ids is not None, "context parallelism needs the batch's document ids"
    cache = _routing.plans
    key = ("ring", id(module))
    if cache is not None and key in cache:
        plan = cache[key]
        _routing.calls_by_path["ring-plan-reused"] += 1
    else:
        layout = TokenLayout(cp.layout, cp.topology.world, cp.block, q_BHSD.shape[2] * cp.topology.world)
        engine = "triton" if q_BHSD.is_cuda else "torch"
        if _routing.sparse is None:
            settings = SparseSettings(block_size=cp.block, dense_below=2**62)
            pattern = dense_pattern(q_BHSD.shape[0], q_BHSD.shape[1], q_BHSD.device)
        else:
            settings, pattern = _routing.sparse, None
        plan, pattern = plan_ring(q_BHSD, k_BHkSD, document_ids, layout, cp.topology, scale, settings, engine,
                                  pattern)
        if _routing.sparse is not None:
            _routing.recall.append(pattern.recall_BH.mean())
            _routing.density.append(torch.tensor(plan_density(plan, q_BHSD.shape[0] * q_BHSD.shape[1])))
        _routing.ring_work += sum(plan.work_by_source.values())
        if cache is not None:
            cache[key] = plan
    _routing.calls_by_path["ring-sparse" if _routing.sparse is not None else "ring-dense"] += 1
    return ring_attention(q_BHSD, k_BHkSD, v_BHkSD, plan, cp.topology)


def mtrain_attention(module: torch.nn.Module, query_BHSD: torch.Tensor, key_BHkSD: torch.Tensor,
                     value_BHkSD: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, document_ids: torch.Tensor | None = None, **_) -> tuple[torch.Tensor, None]:
    """-> (output [B, S, H, D], None): the shape and contract of transformers' attention functions."""
    assert attention_mask is None, "mtrain masks by document_ids; transformers must not pass a mask"
    assert dropout == 0.0, "attention dropout is not supported"
    with torch.profiler.record_function("mtrain.attention"):  # the attention phase of `mtrain profile step`
        out_BHSD = _attention(module, query_BHSD, key_BHkSD, value_BHkSD, document_ids,
                              scaling if scaling is not None else query_BHSD.shape[-1] ** -0.5)
    return out_BHSD.transpose(1, 2).contiguous(), None


def _attention(module: torch.nn.Module, query_BHSD: torch.Tensor, key_BHkSD: torch.Tensor, value_BHkSD: torch.Tensor,
               document_ids: torch.Tensor | None, scale: float) -> torch.Tensor:
    num_queries, num_keys = query_BHSD.shape[2], key_BHkSD.shape[2]
    if _routing.cp is not None:
        assert num_queries == num_keys, "context-parallel attention is for training (no KV cache)"
        out_BHSD = _ring(module, query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
    elif _routing.sparse is not None and num_queries == num_keys:
        plan = _plan(module, query_BHSD, key_BHkSD, document_ids, scale)
        backend = _routing.backend or default_backend(query_BHSD.device)
        out_BHSD = sparse_attention_with_layout(query_BHSD, key_BHkSD, value_BHkSD, plan, scale, backend)
        _routing.calls_by_path[f"sparse-{backend}"] += 1
    else:
        # Decoding with a KV cache (fewer queries than keys) is dense in both modes: a handful of queries.
        out_BHSD = dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
        _routing.calls_by_path["dense" if _routing.sparse is None else "dense-decode"] += 1
    return out_BHSD


def _no_mask(*_, **__) -> None:
    return None


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, mtrain_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def attention_calls() -> dict[str, int]:
    """How many attention calls each path served since the process started."""
    return dict(_routing.calls_by_path)


def sparse_stats() -> dict[str, float]:
    """Mean recall and density of the sparse plans made since the last call, and the ring work (active blocks)
    of this rank's ring plans; empty when there were none. Resets."""
    stats = {}
    if _routing.recall:
        stats["sparse_recall"] = float(torch.stack(_routing.recall).mean())
        density = [d.density if isinstance(d, SparsePlan) else d for d in _routing.density]
        stats["sparse_density"] = float(torch.stack(density).float().mean())
    if _routing.ring_work:
        stats["ring_work"] = _routing.ring_work
    _routing.recall.clear()
    _routing.density.clear()
    _routing.ring_work = 0.0
    return stats

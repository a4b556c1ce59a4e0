"""The one attention function mtrain registers with transformers' `AttentionInterface`.

HF models call it in place of SDPA/flash for every layer; the model code stays single-device and
unpatched. Packed batches pass `document_ids` [B, S] through the model's forward kwargs; the paths mask by
them without ever building an [S, S] mask (transformers builds none for us: our mask function returns None).

What runs is set once per process with `configure_attention` (dense, or dynamic sparse attention with its
settings and, in GPU training, the crossover rule that runs a layer dense when its plan would be slower).
Every call is counted by path, so a run's summary states which attention actually ran. Inside
`plan_cache()` (one micro-batch's forward and backward), each layer's sparse plan (or dense decision) is
made once and reused when activation checkpointing re-runs that layer's forward.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from mtrain_cli.attention.crossover import REPROBE_EVERY, SparseCost
from mtrain_cli.attention.dense import dense_attention
from mtrain_cli.attention.sparse.layout import HostCopy
from mtrain_cli.attention.sparse.ops import (Backend, SparsePlan, default_backend, plan_sparse,
                                             sparse_attention_with_layout)
from mtrain_cli.attention.settings import AttentionConfig
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


# The crossover rule: (sequence length, head dim) -> the cost of a sparse layer relative to dense.
Crossover = Callable[[int, int], SparseCost]


@dataclass
class _Routing:
    sparse: AttentionConfig | None = None  # None: dense (mode dense)
    backend: Backend | None = None  # None: by device
    cp: ContextParallel | None = None  # None: the whole sequence is in this process
    crossover: Crossover | None = None  # None: sparse layers always run sparse
    calls_by_path: Counter[str] = field(default_factory=Counter)
    plans: dict | None = None  # the active plan cache, keyed by attention module (None: a crossover's dense)
    num_forwards: int = 0  # plan-cache scopes entered: the clock of crossover re-probes
    dense_since: dict[int, int] = field(default_factory=dict)  # module id -> forward it was last planned dense
    last_split: dict[int, HostCopy] = field(default_factory=dict)  # module id -> its last sparse plan's work split
    recall: list[torch.Tensor] = field(default_factory=list)  # per fresh plan, kept on device until read
    recall_layers: list[int | None] = field(default_factory=list)  # the decoder layer of each (module.layer_idx)
    density: list[SparsePlan | torch.Tensor] = field(default_factory=list)  # plans: density computed when read
    work: list[SparsePlan | torch.Tensor | float] = field(default_factory=list)  # per fresh layer call: its plan
    # (or, in training, its work-share bound), or 1.0 (ran dense)
    ring_work: float = 0.0  # active blocks this rank's ring plans compute (for the cp imbalance)


_routing = _Routing()


def configure_attention(attention: AttentionConfig, backend: Backend | None = None,
                        cp: ContextParallel | None = None, crossover: Crossover | None = None) -> None:
    """Dense attention (mode dense) or dynamic sparse attention with these settings, for every layer; over a
    context-parallel ring when `cp` is given (dense then means the dense ring). With `crossover`, a
    single-process sparse layer whose plan computes more than crossover(length, head dim) of the dense work
    runs dense attention instead, for that forward (see attention/crossover.py)."""
    _routing.sparse = attention if attention.mode == "sparse" else None
    _routing.backend, _routing.cp, _routing.crossover = backend, cp, crossover
    _routing.dense_since.clear()
    _routing.last_split.clear()
    sparse_stats()  # records of the previous configuration's calls are not this one's


@contextlib.contextmanager
def plan_cache():
    """Reuse each layer's sparse plan (or its crossover decision) inside this scope: one micro-batch's
    forward, then the recompute during backward, which must take the same path."""
    previous, _routing.plans = _routing.plans, {}
    _routing.num_forwards += 1
    try:
        yield
    finally:
        _routing.plans = previous


def _plan(module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> SparsePlan | None:
    """This layer's plan; None where the crossover rule runs it dense."""
    cache = _routing.plans
    if cache is not None and id(module) in cache:
        plan = cache[id(module)]
        assert plan is None or plan.layout.q_len == q_BHSD.shape[2], "a cached plan must serve the same sequence"
        _routing.calls_by_path["sparse-plan-reused" if plan is not None else "dense-crossover-reused"] += 1
        return plan
    plan = _fresh_plan(module, q_BHSD, k_BHkSD, document_ids, scale)
    if cache is not None:
        cache[id(module)] = plan
    return plan


def _fresh_plan(module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> SparsePlan | None:
    key, cost, previous = id(module), None, None
    if _routing.crossover is not None:
        cost = _routing.crossover(q_BHSD.shape[2], q_BHSD.shape[3])
        last_dense = _routing.dense_since.get(key)
        if cost.never_pays or (last_dense is not None and _routing.num_forwards - last_dense < REPROBE_EVERY):
            return _run_dense()
        previous = _routing.last_split.pop(key, None)
        if previous is not None and not cost.pays(*previous.get()):  # copied a forward ago: no wait
            return _run_dense(key)
    plan = plan_sparse(q_BHSD, k_BHkSD, document_ids, scale, _routing.sparse)
    if cost is not None:
        split = plan.work_split_bound()
        if previous is None and not cost.pays(*split.tolist()):  # a first plan: the host waits, once
            return _run_dense(key)
        _routing.last_split[key] = HostCopy(split)
        _routing.dense_since.pop(key, None)
    _routing.recall.append(plan.recall_BH.mean())
    _routing.recall_layers.append(getattr(module, "layer_idx", None))
    if _routing.plans is not None:  # training: the cheap bounds (exact accounting costs ~1 ms a layer)
        _routing.density.append(plan.density_bound())
        _routing.work.append(plan.work_share_bound())
    else:
        _routing.density.append(plan)
        _routing.work.append(plan)
    return plan


def _run_dense(planned: int | None = None) -> None:
    """A crossover decision: this layer runs dense attention; `planned` (its module id) if it was just
    judged, which starts its dense stretch."""
    if planned is not None:
        _routing.dense_since[planned] = _routing.num_forwards
    _routing.work.append(1.0)
    return None


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
            settings = AttentionConfig(block_size=cp.block, dense_below=2**62)
            pattern = dense_pattern(q_BHSD.shape[0], q_BHSD.shape[1], q_BHSD.device)
        else:
            settings, pattern = _routing.sparse, None
        plan, pattern = plan_ring(q_BHSD, k_BHkSD, document_ids, layout, cp.topology, scale, settings, engine,
                                  pattern)
        if _routing.sparse is not None:
            _routing.recall.append(pattern.recall_BH.mean())
            _routing.recall_layers.append(getattr(module, "layer_idx", None))
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
    # Every path (SDPA, FlexAttention, the Triton kernels, the ring) takes q/k/v in one dtype. Under autocast
    # transformers' rotary step leaves q/k in fp32 while v comes from the projection in the autocast dtype:
    # compute in the autocast dtype then (the output, and so the incoming gradient, follow it).
    dtype = compute_dtype(query_BHSD)
    query_BHSD, key_BHkSD, value_BHkSD = (t.to(dtype) for t in (query_BHSD, key_BHkSD, value_BHkSD))
    with torch.profiler.record_function("mtrain.attention"):  # the attention phase of `mtrain profile step`
        out_BHSD = _attention(module, query_BHSD, key_BHkSD, value_BHkSD, document_ids,
                              scaling if scaling is not None else query_BHSD.shape[-1] ** -0.5)
    return out_BHSD.transpose(1, 2).contiguous(), None


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for the query's device, else the query's own dtype."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return query.dtype


def _attention(module: torch.nn.Module, query_BHSD: torch.Tensor, key_BHkSD: torch.Tensor, value_BHkSD: torch.Tensor,
               document_ids: torch.Tensor | None, scale: float) -> torch.Tensor:
    num_queries, num_keys = query_BHSD.shape[2], key_BHkSD.shape[2]
    if _routing.cp is not None:
        assert num_queries == num_keys, "context-parallel attention is for training (no KV cache)"
        out_BHSD = _ring(module, query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
    elif _routing.sparse is not None and num_queries == num_keys:
        plan = _plan(module, query_BHSD, key_BHkSD, document_ids, scale)
        if plan is None:  # above the crossover: dense is faster for this layer now
            out_BHSD = dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
            _routing.calls_by_path["dense-crossover"] += 1
            return out_BHSD
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


def _by_layer(layers: list[int | None], recall: list[float], density: list[float]) -> dict[str, list[float]]:
    """{decoder layer: [mean recall, mean density]} over the plans of a layer (micro-batches); the keys are
    strings (JSON). Layers that ran dense, or modules without a layer index, are absent."""
    sums: dict[int, list[float]] = {}
    for layer, r, d in zip(layers, recall, density):
        if layer is not None:
            entry = sums.setdefault(layer, [0.0, 0.0, 0])
            entry[0], entry[1], entry[2] = entry[0] + r, entry[1] + d, entry[2] + 1
    return {str(layer): [r / n, d / n] for layer, (r, d, n) in sorted(sums.items())}


def sparse_stats() -> dict[str, Any]:
    """Since the last call (then reset): mean recall and density of the sparse plans that ran, and both per
    decoder layer (`sparse_by_layer`); for
    single-process sparse layers, how many fresh layer calls ran sparse and how many dense by the crossover
    rule, and `attention_work`, the share of dense attention's work they computed (1 for a dense layer);
    the ring work (active blocks) of this rank's ring plans. Empty when no sparse layer ran."""
    stats: dict[str, float] = {}
    density = [d.density if isinstance(d, SparsePlan) else d for d in _routing.density]
    work = [w.work_share if isinstance(w, SparsePlan) else w for w in _routing.work]
    on_device = [*_routing.recall, *density, *(w for w in work if isinstance(w, torch.Tensor))]
    values = (torch.stack([t.float().to(on_device[0].device) for t in on_device]).tolist()  # one host wait
              if on_device else [])
    num_recall = len(_routing.recall)
    if num_recall:
        recall, density = values[:num_recall], values[num_recall:2 * num_recall]
        stats["sparse_recall"] = sum(recall) / num_recall
        stats["sparse_density"] = sum(density) / num_recall
        stats["sparse_by_layer"] = _by_layer(_routing.recall_layers, recall, density)
    if work:
        sparse_work = iter(values[2 * num_recall:])
        shares = [w if isinstance(w, float) else next(sparse_work) for w in work]
        stats["attention_work"] = sum(shares) / len(shares)
        stats["sparse_layers"] = sum(not isinstance(w, float) for w in work)
        stats["dense_layers"] = len(shares) - stats["sparse_layers"]
    if _routing.ring_work:
        stats["ring_work"] = _routing.ring_work
    _routing.recall.clear()
    _routing.recall_layers.clear()
    _routing.density.clear()
    _routing.work.clear()
    _routing.ring_work = 0.0
    return stats

"""The attention router: what every attention call of a model runs, and everything kept across those calls.

HF models call mtrain's one registered attention function (hook.py) for every layer; it hands the call to
the router entered around the forward and backward (`with router:`), as torchtitan applies context
parallelism around the forward with the model code unaware. The router owns:
- the settings: dense, or dynamic sparse attention with its settings and, in GPU training, the crossover
  rule that runs a layer dense when its plan would be slower; over a context-parallel ring or not;
- the state: the per-micro-batch plan cache, the crossover's memory of each layer, the per-batch caches of
  the kernels (BatchCache, PlanGraph) and the records of what ran (records.py).

Inside `micro_batch()` (one micro-batch's forward and backward) each layer's sparse plan (or dense decision)
is made once and reused when activation checkpointing re-runs that layer's forward. The sparse and ring
modules (Triton) are imported on a router's first sparse or ring call: dense attention never loads Triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.crossover import REPROBE_EVERY, SparseCost
from mtrain_cli.attention.dense import dense_attention
from mtrain_cli.attention.records import AttentionRecords
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.parallel.topology import RingTopology

PLAN_RANGE = "mtrain.plan"  # around each fresh plan (pattern estimate + layout): the plan phase of `profile step`
# A sparse layer's dense decisions, named as the attention calls they count: above the crossover (a layer, for a
# while), or a batch with no document of dense_below tokens (its layouts would be all dense ranges, the same
# attention that dense runs faster: FlexAttention's tiles without a plan. 64K rows of short documents on an H100
# took 0.091 s a sparse step against 0.073 dense before this switch, 0.068-0.077 s after it:
# bench/results/extension_experiment_h100_multi.md's notes)
DENSE_CROSSOVER = "dense-crossover"
DENSE_SHORT = "dense-short-documents"

if TYPE_CHECKING:
    from mtrain_cli.attention.sparse.layout import HostCopy
    from mtrain_cli.attention.sparse.ops import Backend, SparsePlan
    from mtrain_cli.attention.sparse.plan_graph import PlanGraph


@dataclass(frozen=True)
class ContextParallel:
    """Attention over a ring of context-parallel ranks: each holds its `layout` share of every sequence."""

    topology: RingTopology
    layout: str  # "stripe" or "zigzag"
    block: int


# The crossover rule: (sequence length, head dim) -> the cost of a sparse layer relative to dense.
Crossover = Callable[[int, int], SparseCost]

# The routers entered, innermost last. A process-wide stack rather than a ContextVar: on a GPU the autograd
# engine runs backward, and the activation-checkpoint recompute inside it, on its own threads, which do not
# see the context variables of the thread that entered the router.
_entered: list[AttentionRouter] = []


def active_router() -> AttentionRouter:
    if not _entered:
        raise RuntimeError(
            "mtrain attention was called outside an attention router: enter `with AttentionRouter("
            "...):` (mtrain_cli.attention.router) around the model's forward and backward"
        )
    return _entered[-1]


class AttentionRouter:
    """Dense attention (`attention` None or mode dense) or dynamic sparse attention with these settings, for
    every layer; over a context-parallel ring when `cp` is given (dense then means the dense ring). A
    single-process sparse call on a batch without a document of `dense_below` tokens runs dense attention (what
    its layout would compute, by the faster kernels). With `crossover`, a single-process sparse layer whose plan
    computes more than crossover(length, head dim) of the dense work runs dense attention instead, for that
    forward (see attention/crossover.py). `backend`: the sparse kernels' (None: by device)."""

    def __init__(
        self,
        attention: AttentionConfig | None = None,
        backend: Backend | None = None,
        cp: ContextParallel | None = None,
        crossover: Crossover | None = None,
    ):
        self.sparse = attention if attention is not None and attention.mode == "sparse" else None
        self.backend, self.cp, self.crossover = backend, cp, crossover
        self.records = AttentionRecords()
        self.batch_cache = BatchCache()
        self._plan_graph: PlanGraph | None = None  # made with the first sparse plan
        self._plans: dict | None = None  # the micro-batch's plans by attention module (or its dense decision)
        # The crossover's memory, by decoder layer (saved in checkpoints: a resumed run takes the same paths)
        self._num_forwards = 0  # micro-batches entered: the clock of crossover re-probes
        self._dense_since: dict[int, int] = {}  # layer -> forward it was last planned dense
        self._last_split: dict[int, HostCopy] = {}  # layer -> its last sparse plan's work split

    def __enter__(self) -> AttentionRouter:
        _entered.append(self)
        return self

    def __exit__(self, *_) -> None:
        assert _entered and _entered[-1] is self, "attention routers must be left in the order they were entered"
        _entered.pop()

    @contextlib.contextmanager
    def micro_batch(self):
        """Reuse each layer's sparse plan (or its crossover decision) inside this scope: one micro-batch's
        forward, then the recompute during backward, which must take the same path."""
        previous, self._plans = self._plans, {}
        self._num_forwards += 1
        try:
            yield
        finally:
            self._plans = previous

    def crossover_state(self) -> dict[str, Any]:
        """The crossover rule's memory of each layer (what it last decided, from which forward), for a checkpoint.
        Reads the last work splits back from the device: once per checkpoint."""
        return {
            "num_forwards": self._num_forwards,
            "dense_since": dict(self._dense_since),
            "last_split": {layer: split.get() for layer, split in self._last_split.items()},
        }

    def load_crossover_state(self, state: dict[str, Any]) -> None:
        """What `crossover_state` saved; {} (a checkpoint without it) leaves the memory empty."""
        if not state:
            return
        self._num_forwards = state["num_forwards"]
        self._dense_since = dict(state["dense_since"])
        if state["last_split"]:
            from mtrain_cli.attention.sparse.layout import HostCopy

            self._last_split = {  # float64 holds the saved values exactly, whatever the split's dtype was
                layer: HostCopy(torch.tensor(split, dtype=torch.float64))
                for layer, split in state["last_split"].items()
            }

    def calls(self) -> dict[str, int]:
        """How many attention calls each path served since this router was made."""
        return dict(self.records.calls_by_path)

    def sparse_stats(self) -> dict[str, Any]:
        """The sparse plans' records since the last call (see AttentionRecords.sparse_stats)."""
        return self.records.sparse_stats()

    def drop_records(self) -> None:
        """Forget the plans recorded since the last `sparse_stats`, unread."""
        self.records.clear()

    def attention(
        self,
        module: torch.nn.Module,
        query_BHSD: torch.Tensor,
        key_BHkSD: torch.Tensor,
        value_BHkSD: torch.Tensor,
        document_ids: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """-> [B, H, Sq, D]: q/k/v in one dtype."""
        num_queries, num_keys = query_BHSD.shape[2], key_BHkSD.shape[2]
        calls = self.records.calls_by_path
        if self.cp is not None:
            assert num_queries == num_keys, "context-parallel attention is for training (no KV cache)"
            return self._ring(module, query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale)
        if self.sparse is not None and num_queries == num_keys:
            plan = self._plan(module, query_BHSD, key_BHkSD, document_ids, scale)
            if isinstance(plan, str):  # DENSE_SHORT or DENSE_CROSSOVER: dense is faster for this call
                calls[plan] += 1
                return dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale, self.batch_cache)
            from mtrain_cli.attention.sparse.ops import default_backend, sparse_attention_with_layout

            backend = self.backend or default_backend(query_BHSD.device)
            calls[f"sparse-{backend}"] += 1
            return sparse_attention_with_layout(
                query_BHSD, key_BHkSD, value_BHkSD, plan, scale, backend, self.batch_cache
            )
        # Decoding with a KV cache (fewer queries than keys) is dense in both modes: a handful of queries.
        calls["dense" if self.sparse is None else "dense-decode"] += 1
        return dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale, self.batch_cache)

    def _plan(self, module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> SparsePlan | str:
        """This layer's plan, or its dense decision (DENSE_SHORT, DENSE_CROSSOVER)."""
        cache = self._plans
        if cache is not None and id(module) in cache:
            plan = cache[id(module)]
            dense = isinstance(plan, str)
            assert dense or plan.layout.q_len == q_BHSD.shape[2], "a cached plan must serve the same sequence"
            self.records.calls_by_path[f"{plan}-reused" if dense else "sparse-plan-reused"] += 1
            return plan
        plan = self._fresh_plan(module, q_BHSD, k_BHkSD, document_ids, scale)
        if cache is not None:
            cache[id(module)] = plan
        return plan

    def _fresh_plan(self, module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> SparsePlan | str:
        from mtrain_cli.attention.sparse import ops
        from mtrain_cli.attention.sparse.layout import HostCopy
        from mtrain_cli.attention.sparse.plan_graph import PlanGraph

        B, _, S, _ = q_BHSD.shape
        if ops.batch_documents(document_ids, B, S, q_BHSD.device, self.batch_cache).longest < self.sparse.dense_below:
            self.records.work.append(1.0)  # the batch's rows: nothing to plan (a property of the batch, not the
            self.records.num_short += 1  # layer, so the crossover's memory of the layer is left alone)
            return DENSE_SHORT
        key, cost, previous = None, None, None
        if self.crossover is not None:
            key, cost = module.layer_idx, self.crossover(q_BHSD.shape[2], q_BHSD.shape[3])
            last_dense = self._dense_since.get(key)
            if cost.never_pays or (last_dense is not None and self._num_forwards - last_dense < REPROBE_EVERY):
                return self._run_dense()
            previous = self._last_split.pop(key, None)
            if previous is not None and not cost.pays(*previous.get()):  # copied a forward ago: no wait
                return self._run_dense(key)
        if self._plan_graph is None:
            self._plan_graph = PlanGraph()
        with torch.profiler.record_function(PLAN_RANGE):
            plan = ops.plan_sparse(
                q_BHSD, k_BHkSD, document_ids, scale, self.sparse, self.batch_cache, self._plan_graph
            )
        if cost is not None:
            split = plan.work_split_bound()
            if previous is None and not cost.pays(*split.tolist()):  # a first plan: the host waits, once
                return self._run_dense(key)
            self._last_split[key] = HostCopy(split)
            self._dense_since.pop(key, None)
        records = self.records
        records.recall.append(plan.recall_BH.mean())
        records.recall_layers.append(getattr(module, "layer_idx", None))
        # computed when read (records.py); training takes the cheap bounds (exact accounting costs ~1 ms a layer)
        training = self._plans is not None
        records.density.append(plan.density_bound if training else lambda: plan.density)
        records.work.append(plan.work_share_bound if training else lambda: plan.work_share)
        return plan

    def _run_dense(self, planned: int | None = None) -> str:
        """A crossover decision: this layer runs dense attention; `planned` (its layer index) if it was just
        judged, which starts its dense stretch."""
        if planned is not None:
            self._dense_since[planned] = self._num_forwards
        self.records.work.append(1.0)
        return DENSE_CROSSOVER

    def _ring(self, module: torch.nn.Module, q_BHSD, k_BHkSD, v_BHkSD, document_ids, scale) -> torch.Tensor:
        from mtrain_cli.attention.ring.cp_attention import dense_pattern, plan_density, plan_ring, ring_attention
        from mtrain_cli.parallel.layouts import TokenLayout

        cp, records = self.cp, self.records
        assert document_ids is not None, "context parallelism needs the batch's document ids"
        cache = self._plans
        key = ("ring", id(module))
        if cache is not None and key in cache:
            plan = cache[key]
            records.calls_by_path["ring-plan-reused"] += 1
        else:
            layout = TokenLayout(cp.layout, cp.topology.world, cp.block, q_BHSD.shape[2] * cp.topology.world)
            engine = "triton" if q_BHSD.is_cuda else "torch"
            if self.sparse is None:
                settings = AttentionConfig(block_size=cp.block, dense_below=2**62)
                pattern = dense_pattern(q_BHSD.shape[0], q_BHSD.shape[1], q_BHSD.device)
            else:
                settings, pattern = self.sparse, None
            with torch.profiler.record_function(PLAN_RANGE):
                plan, pattern = plan_ring(
                    q_BHSD,
                    k_BHkSD,
                    document_ids,
                    layout,
                    cp.topology,
                    scale,
                    settings,
                    engine,
                    self.batch_cache,
                    pattern,
                )
            if self.sparse is not None:
                records.recall.append(pattern.recall_BH.mean())
                records.recall_layers.append(getattr(module, "layer_idx", None))
                records.density.append(torch.tensor(plan_density(plan, q_BHSD.shape[0] * q_BHSD.shape[1])))
            records.ring_work += sum(plan.work_by_source.values())
            if cache is not None:
                cache[key] = plan
        records.calls_by_path["ring-sparse" if self.sparse is not None else "ring-dense"] += 1
        return ring_attention(q_BHSD, k_BHkSD, v_BHkSD, plan, cp.topology)

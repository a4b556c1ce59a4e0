"""The attention router: what every attention call of a model runs.

HF models call mtrain's one registered attention function (hook.py) for every layer; it hands the call to
the router entered around the forward and backward (`with router:`), as torchtitan applies context
parallelism around the forward with the model code unaware. The router decides each call's route (dense,
sparse with a plan, or dense where sparse would not pay) and runs it; what it keeps across calls lives in
the parts it holds: the crossover policy's memory of each layer (crossover.py), the per-batch caches of the
kernels (BatchCache, PlanGraph) and the records of what ran (records.py).

Inside `micro_batch()` (one micro-batch's forward and backward) each layer's decision is made once and reused
when activation checkpointing re-runs that layer's forward. The sparse and ring modules (Triton) are imported
on a router's first sparse or ring call: dense attention never loads Triton.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.crossover import CrossoverPolicy
from mtrain_cli.attention.dense import dense_attention
from mtrain_cli.attention.documents import HostDocuments
from mtrain_cli.attention.records import AttentionRecords, CallPath, PendingStats, Route
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.parallel import ContextParallel

PLAN_RANGE = "mtrain.plan"  # around each fresh plan (pattern estimate + layout): the plan phase of `profile step`

if TYPE_CHECKING:
    from mtrain_cli.attention.recall_control import RecallController
    from mtrain_cli.attention.ring.ring import RingPlan
    from mtrain_cli.attention.sparse.engine import Engine
    from mtrain_cli.attention.sparse.ops import SparsePlan
    from mtrain_cli.attention.sparse.plan_graph import PlanGraph


def route_layer(
    settings: AttentionConfig,
    layer: int | None,
    longest_document: int,
    recall_dense: bool = False,
    dense_step: bool = False,
) -> Route:
    """A sparse-mode layer's route for a batch by the rules that need no plan, the same over a ring as in one
    process: a step of `dense_every` (`dense_step`), `dense_layers`, then `dense_below` (a property of the batch,
    not the layer), then the recall controller's density ceiling (`recall_dense`: the layer is in a dense
    stretch). SPARSE: plan it (in one process the crossover rule may still send it dense, attention/crossover.py)."""
    if dense_step:
        return Route.DENSE_STEP
    if layer in settings.dense_layers:
        return Route.DENSE_LAYER
    if longest_document < settings.dense_below:
        return Route.DENSE_SHORT
    if recall_dense:
        return Route.DENSE_RECALL
    return Route.SPARSE


@dataclass(frozen=True)
class Decision:
    """A layer's route for one micro-batch and the plan that serves it: a single-process sparse plan (None for a
    dense route), or over a ring the ring's plan (the dense ring's for a dense route)."""

    route: Route | None  # None: dense mode over a ring
    plan: SparsePlan | RingPlan | None = None


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
    its layout would compute, by the faster kernels). With a `crossover` policy, a single-process sparse layer
    whose plan would be slower than dense attention runs dense instead (see attention/crossover.py); with a
    `recall` controller, each layer's flex limits follow the recall target (attention/recall_control.py).
    `engine`: what computes the sparse layouts (None: by device)."""

    def __init__(
        self,
        attention: AttentionConfig | None = None,
        engine: Engine | None = None,
        cp: ContextParallel | None = None,
        crossover: CrossoverPolicy | None = None,
        recall: RecallController | None = None,
    ):
        self.sparse = attention if attention is not None and attention.mode == "sparse" else None
        self.engine, self.cp, self.crossover, self.recall = engine, cp, crossover, recall
        self.records = AttentionRecords()
        self.batch_cache = BatchCache()
        self._plan_graph: PlanGraph | None = None  # made with the first sparse plan
        self._decisions: dict[int, Decision] | None = None  # the micro-batch's decisions by attention module
        self._dense_step = False  # inside dense_step(True): every sparse-mode layer runs dense

    def __enter__(self) -> AttentionRouter:
        _entered.append(self)
        return self

    def __exit__(self, *_) -> None:
        assert _entered and _entered[-1] is self, "attention routers must be left in the order they were entered"
        _entered.pop()

    @contextlib.contextmanager
    def micro_batch(self):
        """Reuse each layer's decision inside this scope: one micro-batch's forward, then the recompute during
        backward, which must take the same route."""
        previous, self._decisions = self._decisions, {}
        if self.crossover is not None:
            self.crossover.start_forward()
        try:
            yield
        finally:
            self._decisions = previous

    @contextlib.contextmanager
    def dense_step(self, dense: bool):
        """A training step; with `dense`, a step of `attention.dense_every`: every layer runs dense (route
        dense-step, counted as the other dense routes are)."""
        previous, self._dense_step = self._dense_step, dense
        try:
            yield
        finally:
            self._dense_step = previous

    def calls(self) -> dict[str, int]:
        """How many attention calls each path (records.CallPath, by value) served since this router was made."""
        return {path.value: count for path, count in self.records.calls_by_path.items()}

    def sparse_stats(self) -> dict[str, Any]:
        """The sparse plans' records since the last call (see AttentionRecords.sparse_stats)."""
        return self.records.sparse_stats()

    def take_sparse_stats(self) -> PendingStats:
        """sparse_stats, taken now and read later (AttentionRecords.take_stats)."""
        return self.records.take_stats()

    def plan_captures(self) -> int:
        """How many sparse plans were captured as CUDA graphs (a new shape each) since this router was made."""
        return self._plan_graph.num_captures if self._plan_graph is not None else 0

    def add_host_documents(
        self, document_ids: torch.Tensor, row_ids_BS: torch.Tensor, rows_on_device: torch.Tensor | None = None
    ) -> None:
        """The batch whose ids (a ring rank: its shard of them) are `document_ids` holds the whole rows
        `row_ids_BS`, on the host; `rows_on_device`: the same uploaded, for a ring. Its plans read these instead of
        the device, and a ring gathers no ids."""
        self.batch_cache.add_host_documents(document_ids, HostDocuments.of(row_ids_BS, rows_on_device))

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
        if self.cp is not None:
            assert num_queries == num_keys, "context-parallel attention is for training (no KV cache)"
            from mtrain_cli.attention.ring.cp_attention import ring_attention

            decision = self._decide(module, query_BHSD, key_BHkSD, document_ids, scale)
            self.records.count_call(CallPath.RING_SPARSE if self.sparse is not None else CallPath.RING_DENSE)
            return ring_attention(query_BHSD, key_BHkSD, value_BHkSD, decision.plan, self.cp.topology)
        if self.sparse is not None and num_queries == num_keys:
            decision = self._decide(module, query_BHSD, key_BHkSD, document_ids, scale)
            if decision.route is not Route.SPARSE:  # dense is faster for this call, or the rules ask for it
                return dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale, self.batch_cache)
            from mtrain_cli.attention.sparse.ops import sparse_attention_with_layout

            engine = self._engine(query_BHSD)
            self.records.count_call(CallPath.SPARSE_TRITON if engine == "triton" else CallPath.SPARSE_REFERENCE)
            return sparse_attention_with_layout(
                query_BHSD, key_BHkSD, value_BHkSD, decision.plan, scale, engine, self.batch_cache
            )
        # Decoding with a KV cache (fewer queries than keys) is dense in both modes: a handful of queries.
        self.records.count_call(CallPath.DENSE if self.sparse is None else CallPath.DENSE_DECODE)
        return dense_attention(query_BHSD, key_BHkSD, value_BHkSD, document_ids, scale, self.batch_cache)

    def _engine(self, q_BHSD: torch.Tensor) -> Engine:
        from mtrain_cli.attention.sparse.engine import default_engine

        return self.engine or default_engine(q_BHSD.device)

    def _decide(self, module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> Decision:
        """This layer's decision for the micro-batch: made once, reused by the recompute."""
        decisions = self._decisions
        if decisions is not None and id(module) in decisions:
            decision = decisions[id(module)]
            if self.cp is not None:
                self.records.count_call(CallPath.RING_REUSED)
            else:
                assert decision.plan is None or decision.plan.layout.q_len == q_BHSD.shape[2], (
                    "a cached plan must serve the same sequence"
                )
                self.records.count_call(CallPath.of_route(decision.route, reused=True))
            return decision
        if self.cp is not None:
            decision = self._fresh_ring_decision(module, q_BHSD, k_BHkSD, document_ids, scale)
        else:
            decision = self._fresh_decision(module, q_BHSD, k_BHkSD, document_ids, scale)
        if decision.route not in (None, Route.SPARSE):
            self.records.count_call(CallPath.of_route(decision.route, reused=False))
            self.records.record_dense(decision.route)
        if decisions is not None:
            decisions[id(module)] = decision
        return decision

    def _plan_graph_for(self) -> PlanGraph:
        if self._plan_graph is None:
            from mtrain_cli.attention.sparse.plan_graph import PlanGraph

            self._plan_graph = PlanGraph()
        return self._plan_graph

    def _fresh_decision(self, module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> Decision:
        from mtrain_cli.attention.sparse import ops

        B, H, S, D = q_BHSD.shape
        layer = getattr(module, "layer_idx", None)
        longest = ops.batch_documents(document_ids, B, S, q_BHSD.device, self.batch_cache).longest
        recall_dense = self.recall is not None and self.recall.runs_dense(layer)
        route = route_layer(self.sparse, layer, longest, recall_dense, self._dense_step)
        if route is not Route.SPARSE:
            return Decision(route)
        graph = self._plan_graph_for()
        limits = self.recall.limits(layer, H, S, q_BHSD.device) if self.recall is not None else None

        def make_plan() -> SparsePlan:
            with torch.profiler.record_function(PLAN_RANGE):
                return ops.plan_sparse(
                    q_BHSD, k_BHkSD, document_ids, scale, self.sparse, self.batch_cache, graph, limits
                )

        if self.crossover is None:
            plan = make_plan()
        elif (plan := self.crossover.plan_or_dense(layer, S, D, make_plan)) is None:
            return Decision(Route.DENSE_CROSSOVER)
        # density and work are computed when read (records.py); training takes the cheap bounds (exact
        # accounting costs ~1 ms a layer)
        training = self._decisions is not None
        self.records.record_sparse(
            layer,
            plan.recall_BH,
            plan.chosen_BH,
            plan.density_bound if training else lambda: plan.density,
            plan.work_share_bound if training else lambda: plan.work_share,
        )
        return Decision(Route.SPARSE, plan)

    def _fresh_ring_decision(self, module: torch.nn.Module, q_BHSD, k_BHkSD, document_ids, scale) -> Decision:
        """Over a ring every call has a plan: the sparse ring's, or the dense ring's for a dense route (and in
        dense mode, where the route is None)."""
        from mtrain_cli.attention.ring.cp_attention import global_documents, plan_density, plan_ring

        assert document_ids is not None, "context parallelism needs the batch's document ids"
        B, H, S, _ = q_BHSD.shape
        token_layout = self.cp.token_layout(S * self.cp.topology.world)
        layer = getattr(module, "layer_idx", None)
        route = None
        if self.sparse is not None:
            documents = global_documents(document_ids, token_layout, self.cp.topology, q_BHSD.device, self.batch_cache)
            recall_dense = self.recall is not None and self.recall.runs_dense(layer)
            route = route_layer(self.sparse, layer, documents.longest, recall_dense, self._dense_step)
        sparse = route is Route.SPARSE
        limits = None
        if sparse and self.recall is not None:  # every rank of the ring holds the same controller state
            limits = self.recall.limits(layer, H, S * self.cp.topology.world, q_BHSD.device)
        engine = self.engine or ("triton" if q_BHSD.is_cuda else "reference")
        with torch.profiler.record_function(PLAN_RANGE) if sparse else contextlib.nullcontext():
            plan, pattern = plan_ring(
                q_BHSD,
                k_BHkSD,
                document_ids,
                token_layout,
                self.cp.topology,
                scale,
                self.sparse if sparse else None,
                engine,
                self.batch_cache,
                self._plan_graph_for() if sparse else None,
                limits,
            )
        if pattern is None:  # exact (no vertical columns); the plan serves the batch's every layer and counts once
            self.records.record_ring(None, None, None, None, lambda: plan.walked_blocks)
        else:
            # computed when read (records.py), once per plan; training takes the bound, as one process does (the
            # exact count is ~30 small kernels and a host read per chunk pair and layer)
            work = (lambda: plan.walked_blocks) if self._decisions is not None else (lambda: plan.work)
            density = lambda: plan_density(plan, B * H, work())  # noqa: E731
            self.records.record_ring(layer, pattern.recall_BH, pattern.chosen_BH, density, work)
        return Decision(route, plan)

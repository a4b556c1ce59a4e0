"""Sparse ring attention over context-parallel ranks: flat or hierarchical (inner ring within a node, outer
ring across nodes), forward and backward, as one autograd function.

Topology: W = N nodes × L ranks; rank = node·L + local. At outer step o and inner step i, rank (n, l) holds
the K/V of rank ((n - o) mod N, (l - i) mod L), so over N·L steps every rank sees every chunk once. A flat
ring is N = 1.
Forward: while the inner ring passes K/V around the node (one `batch_isend_irecv` pair per step, started
before the step's kernel so it overlaps), the outer ring already sends the chunk to the next node and
receives the next one, hidden behind the whole inner ring. Partial outputs merge by LSE in fp32.
Backward: K/V travel again (prefetched during each step's compute), and the fp32 dK/dV accumulators follow
them one step behind: each step writes its dK/dV into a fresh buffer, adds the accumulator that arrived
meanwhile and sends it on, so transfers overlap compute. After the inner ring an accumulator is back on
the rank that started it, then goes on along the outer ring with its K/V; after N outer hops it is home.
Backward recomputes from the received K/V (never the local ones), with the final
LSE and delta = rowsum(dO ∘ O) of the rank's own rows.
Each step's plain chunk pairs (one document, rows dense: ring_plan.py) run a library kernel, coalesced into as
few calls as keep their mask (plain_pairs.py); the pairs that document boundaries cut run our kernels on
their layouts. Both merge into the same fp32 (out, lse) and accumulate into the same fp32 gradients.
Inner and outer rings use their own process groups (own NCCL communicators), so their transfers can run
at the same time; every step's send/recv list is symmetric (one send, one receive per rank).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from mtrain_cli.attention.ring.plain_pairs import library_calls, library_runs, plain_backward, plain_forward
from mtrain_cli.attention.ring.ring_plan import ChunkPair
from mtrain_cli.attention.sparse.chunk import chunk_backward, chunk_forward, row_delta
from mtrain_cli.attention.sparse.engine import Engine
from mtrain_cli.parallel import RingTopology


@dataclass
class RingPlan:
    """Everything a layer's ring needs, computed once per forward and reused by backward."""

    pairs_by_source: dict[int, list[ChunkPair]]  # source rank -> pairs for this rank's queries
    doc_q_BS: torch.Tensor  # this rank's document ids (int32)
    doc_by_rank: list[torch.Tensor]  # every rank's document ids, by rank
    scale: float
    engine: Engine

    def work_by_source(self) -> dict[int, torch.Tensor]:
        """Active blocks (all batch rows and heads) computed against each source rank: 0-dim device values, a few
        dozen small kernels each (count them when read, not while the forward is launched)."""
        return {
            source: torch.stack([pair.layout.active_blocks().sum() for pair in pairs]).sum()
            for source, pairs in self.pairs_by_source.items()
        }

    @functools.cached_property
    def work(self) -> torch.Tensor:
        """Active blocks over every source (see work_by_source); made when first read, once per plan."""
        return torch.stack(list(self.work_by_source().values())).sum()

    @functools.cached_property
    def walked_blocks(self) -> torch.Tensor:
        """0-dim fp64: an upper bound of `work` (BlockLayout.walked_blocks of every pair): a few kernels a pair and
        no host read, cheap enough for training to account every layer of every step; once per plan (the dense
        ring's plan serves every layer of a batch)."""
        pairs = [pair for pairs in self.pairs_by_source.values() for pair in pairs]
        return torch.stack([pair.layout.walked_blocks().sum() for pair in pairs]).sum()

    def causal_blocks(self) -> int:
        """Causal block pairs of one (row, head) over all sources: the dense work (host arithmetic)."""
        return sum(pair.layout.causal_blocks() for pairs in self.pairs_by_source.values() for pair in pairs)


class StepRunner(Protocol):
    """Runs each ring step's compute: the ring's one extension point, for instruments such as `mtrain profile
    ring`'s (step timings; the same work with transfers skipped)."""

    transfers: bool  # False: every step computes on the local K/V (the same work, no communication)

    def __call__(self, phase: str, compute: Callable[[], None]) -> None:
        """Run `compute`, one step of `phase` ("forward" or "backward")."""


class _Direct:
    transfers = True

    def __call__(self, phase: str, compute: Callable[[], None]) -> None:
        compute()


DIRECT = _Direct()


def _exchange(send: list[torch.Tensor], to: int, frm: int, group) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Start sending `send` to rank `to` and receiving same-shaped tensors from `frm` (symmetric list)."""
    recv = [torch.empty_like(t) for t in send]
    ops = [dist.P2POp(dist.isend, t, to, group) for t in send] + [dist.P2POp(dist.irecv, t, frm, group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def _kernel_pairs(plan: RingPlan, source: int, library: bool) -> list[ChunkPair]:
    """The step's pairs our kernels run: all of them, or (library) the cut ones."""
    pairs = plan.pairs_by_source[source]
    return [p for p in pairs if p.plain is None] if library else pairs


def _forward_step(plan: RingPlan, q, kv, source: int, out, lse, library: bool) -> None:
    k, v = kv[0], kv[1]
    doc_k = plan.doc_by_rank[source]
    if library:
        for call in library_calls(plan.pairs_by_source[source]):
            qs, ks = call.q_slice, call.k_slice
            plain_forward(
                plan.engine, q[:, :, qs], k[:, :, ks], v[:, :, ks], call, plan.scale, out[:, :, qs], lse[:, :, qs]
            )
    for pair in _kernel_pairs(plan, source, library):
        chunk_forward(
            plan.engine,
            q[:, :, pair.q_slice],
            k[:, :, pair.k_slice],
            v[:, :, pair.k_slice],
            pair.layout,
            plan.doc_q_BS[:, pair.q_slice],
            doc_k[:, pair.k_slice],
            plan.scale,
            out[:, :, pair.q_slice],
            lse[:, :, pair.q_slice],
            pair.mask_bounds,
        )


def _backward_step(plan: RingPlan, q, kv, acc, source: int, out, lse, dout, delta, dq, out_lowp) -> None:
    """out_lowp: the final output in q's dtype, for the library (None: no library call)."""
    if out_lowp is not None:
        for call in library_calls(plan.pairs_by_source[source]):
            qs, ks = call.q_slice, call.k_slice
            plain_backward(
                plan.engine,
                q[:, :, qs],
                kv[0][:, :, ks],
                kv[1][:, :, ks],
                out_lowp[:, :, qs],
                lse[:, :, qs],
                dout[:, :, qs],
                delta[:, :, qs],
                call,
                plan.scale,
                (dq[:, :, qs], acc[0][:, :, ks], acc[1][:, :, ks]),
            )
    for pair in _kernel_pairs(plan, source, out_lowp is not None):
        qs, ks = pair.q_slice, pair.k_slice
        chunk_backward(
            plan.engine,
            q[:, :, qs],
            kv[0][:, :, ks],
            kv[1][:, :, ks],
            out[:, :, qs],
            lse[:, :, qs],
            dout[:, :, qs],
            delta[:, :, qs],
            pair.layout,
            plan.doc_q_BS[:, qs],
            plan.doc_by_rank[source][:, ks],
            plan.scale,
            (dq[:, :, qs], acc[0][:, :, ks], acc[1][:, :, ks]),
            pair.mask_bounds,
        )


def _any_plain(plan: RingPlan) -> bool:
    return any(pair.plain is not None for pairs in plan.pairs_by_source.values() for pair in pairs)


class RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHkSD, v_BHkSD, plan: RingPlan, topo: RingTopology, run_step: StepRunner):
        B, H, S, D = q_BHSD.shape
        out = torch.zeros(B, H, S, D, dtype=torch.float32, device=q_BHSD.device)
        lse = torch.full((B, H, S), -torch.inf, dtype=torch.float32, device=q_BHSD.device)
        kv = torch.stack([k_BHkSD, v_BHkSD])
        inner_next, inner_prev = topo.inner_peers()
        outer_next, outer_prev = topo.outer_peers()
        comm = run_step.transfers
        library = _any_plain(plan) and library_runs(plan.engine, q_BHSD)
        for o in range(topo.num_nodes):
            outer = (
                _exchange([kv], outer_next, outer_prev, topo.outer_group) if comm and o < topo.num_nodes - 1 else None
            )
            current = kv
            for i in range(topo.node_size):
                inner = (
                    _exchange([current], inner_next, inner_prev, topo.inner_group)
                    if comm and i < topo.node_size - 1
                    else None
                )
                source = topo.source(o, i)
                run_step("forward", lambda: _forward_step(plan, q_BHSD, current, source, out, lse, library))
                if inner is not None:
                    _wait(inner[0])
                    current = inner[1][0]
            if outer is not None:
                _wait(outer[0])
                kv = outer[1][0]
        ctx.save_for_backward(q_BHSD, k_BHkSD, v_BHkSD, out, lse)
        ctx.plan, ctx.topo, ctx.run_step, ctx.library = plan, topo, run_step, library
        return out.to(q_BHSD.dtype)

    @staticmethod
    def backward(ctx, dout_BHSD):
        q, k, v, out, lse = ctx.saved_tensors
        plan, topo, run_step = ctx.plan, ctx.topo, ctx.run_step
        dout = dout_BHSD.contiguous()
        delta = row_delta(plan.engine, out, dout)
        out_lowp = out.to(q.dtype) if ctx.library else None  # what the forward returned
        dq = torch.zeros_like(out)
        kv = torch.stack([k, v])
        acc = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # dK, dV of the chunk held
        inner_next, inner_prev = topo.inner_peers()
        outer_next, outer_prev = topo.outer_peers()
        comm = run_step.transfers
        inner_ring = comm and topo.node_size > 1
        for o in range(topo.num_nodes):
            current_kv, acc_in, pending = kv, acc, None
            for i in range(topo.node_size):
                source = topo.source(o, i)
                # prefetch the next K/V while computing; this step's dK/dV go to a fresh buffer, so the
                # accumulator sent by the previous rank can still be in flight (added after the compute)
                prefetch = (
                    _exchange([current_kv], inner_next, inner_prev, topo.inner_group)
                    if inner_ring and i < topo.node_size - 1
                    else None
                )
                part = torch.zeros_like(acc)
                run_step(
                    "backward",
                    lambda: _backward_step(
                        plan,
                        q,
                        current_kv,
                        part,
                        source,
                        out,
                        lse,
                        dout,
                        delta,
                        dq,
                        out_lowp,
                    ),
                )
                if pending is not None:
                    _wait(pending[0])
                    acc_in = pending[1][0]
                current_acc = acc_in + part
                pending = _exchange([current_acc], inner_next, inner_prev, topo.inner_group) if inner_ring else None
                if prefetch is not None:
                    _wait(prefetch[0])
                    current_kv = prefetch[1][0]
            if pending is not None:  # the last exchange brought home the accumulator this rank started with
                _wait(pending[0])
                current_acc = pending[1][0]
            if comm and topo.num_nodes > 1:
                last = o == topo.num_nodes - 1
                works, received = _exchange(
                    [current_acc] if last else [kv, current_acc], outer_next, outer_prev, topo.outer_group
                )
                _wait(works)
                acc = received[-1]
                if not last:
                    kv = received[0]
            else:
                acc = current_acc
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None

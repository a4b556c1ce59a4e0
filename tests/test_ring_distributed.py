"""The sparse ring under gloo with several processes equals single-process attention on the same global
pattern: outputs and dQ/dK/dV, packed multi-document rows, stripe and zigzag, W = 1..4, hierarchical 2 × 2;
and the distributed pattern estimate equals the single-process one (its partial statistics, summed over the
ranks, equal the single-process statistics)."""

from __future__ import annotations

import faulthandler
import functools
import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import free_port, run_ranks

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring.cp_attention import (
    plan_ring,
    rank_probe_keys,
    ring_attention,
    ring_geometry,
    ring_reduce,
)
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse import pattern as pattern_module
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.pattern import (
    FlexLimits,
    estimate_pattern,
    probe_queries,
    probe_rows,
    probe_statistics,
)
from mtrain_cli.attention.sparse.plan_graph import PlanGraph, planner
from mtrain_cli.attention.sparse.reference import reference_attention
from mtrain_cli.parallel.layouts import TokenLayout, padded_length
from mtrain_cli.parallel.topology import build_topology

BLOCK, SCALE = 16, 0.3
SETTINGS = AttentionConfig(
    pattern="budget",
    num_vertical=4,
    num_slash=4,
    last_q=BLOCK,
    block_size=BLOCK,
    local_window=BLOCK,
    dense_below=40,
    num_sink=2,
)


def _init_rank(rank: int, world: int, port: int) -> None:
    # One intra-op thread per rank: the ranks already fill the cores, and MKL resolves a vector math function
    # (exp, ...) on its first call, which, run on several threads at once, can take a low-accuracy kernel for
    # one thread's chunk (pytorch/pytorch#188792: here exp off by 3e-9 relative, once every few runs).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _ring_case(
    rank: int,
    world: int,
    port: int,
    kind: str,
    ring: int,
    node_size: int,
    engine: str,
    probe_windows: int = 1,
    head_by_head: bool = False,
) -> None:
    """head_by_head: the ring estimates one head at a time (its reduces per head), the single process all at once."""
    _init_rank(rank, world, port)
    settings = replace(SETTINGS, probe_windows=probe_windows)
    torch.manual_seed(0)
    lengths = [70, 23, 90, 33]
    seq_len = padded_length(sum(lengths), kind, ring, BLOCK)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, seq_len, 16, generator=gen)
    k, v = torch.randn(1, 2, seq_len, 16, generator=gen), torch.randn(1, 2, seq_len, 16, generator=gen)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None]

    # single process: pattern, layout, reference output and gradients
    pattern = estimate_pattern(q, k, doc, SCALE, settings)
    start, length = document_spans(doc)
    full = build_layout(pattern, start, length, seq_len, BLOCK, settings.dense_below)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*leaves, full, doc, doc, SCALE)
    dout = torch.randn(ref_out.shape, generator=gen)
    ref_out.backward(dout)

    # this rank's shard through the ring
    token_layout = TokenLayout(kind, ring, BLOCK, seq_len)
    topo = build_topology(node_size, ring)  # world // ring independent rings (data-parallel replicas)
    index = token_layout.positions(topo.rank)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    buffer_bytes = pattern_module.PROBE_BUFFER_BYTES
    if head_by_head:
        pattern_module.PROBE_BUFFER_BYTES = 1  # set back below: the process runs further cases
    plan, local_pattern = plan_ring(
        local[0].detach(),
        local[1].detach(),
        doc[:, index],
        token_layout,
        topo,
        SCALE,
        settings,
        engine,
        BatchCache(),
    )
    assert torch.equal(local_pattern.vertical_BHV, pattern.vertical_BHV), "distributed verticals differ"
    assert torch.equal(local_pattern.slash_BHL, pattern.slash_BHL), "distributed slashes differ"
    torch.testing.assert_close(local_pattern.recall_BH, pattern.recall_BH, atol=1e-5, rtol=1e-5)
    _check_planner(
        local[0].detach(), local[1].detach(), doc[:, index], token_layout, topo, plan, local_pattern, settings
    )
    pattern_module.PROBE_BUFFER_BYTES = buffer_bytes
    out = ring_attention(*local, plan, topo)
    out.backward(dout[:, :, index])
    torch.testing.assert_close(out, ref_out[:, :, index].detach(), atol=2e-5, rtol=1e-4)
    for name, got, want in zip("qkv", local, leaves):
        torch.testing.assert_close(
            got.grad,
            want.grad[:, :, index],
            atol=1e-4,
            rtol=1e-4,
            msg=lambda m, n=name: f"d{n} on rank {rank}: {m}",
        )
    dist.barrier()
    dist.destroy_process_group()


def _check_planner(q_BHSD, k_BHkSD, doc_BS, token_layout, topo, plan, pattern, settings) -> None:
    """What a GPU captures as the ring's plan graph, run twice on its inputs (the warm-up, then the replay):
    each run gives the eager plan and leaves the probe input as it was (the ring's reduce sums in place)."""
    geo = ring_geometry(doc_BS, token_layout, topo, settings, q_BHSD.device, BatchCache())
    probe_in = probe_queries(q_BHSD, geo.rows)
    before = probe_in.clone()
    geometries = tuple(pair.geometry for _, pair in geo.pairs)
    limits = FlexLimits.fixed(settings, q_BHSD.shape[1], q_BHSD.device)
    plan_fn = planner(probe_in, k_BHkSD, geo.rows, geometries, SCALE, settings, limits, ring_reduce(topo.group))
    for _ in range(2):
        got, arrays = plan_fn()
        assert torch.equal(probe_in, before)
        assert torch.equal(got.vertical_BHV, pattern.vertical_BHV) and torch.equal(got.slash_BHL, pattern.slash_BHL)
        layouts = [pair.layout for pairs in plan.pairs_by_source.values() for pair in pairs]
        assert len(arrays) == len(layouts)
        for got_arrays, layout in zip(arrays, layouts):
            assert torch.equal(got_arrays.row_BHM6, layout.row_BHM6) and torch.equal(
                got_arrays.vcol_BHV, layout.vcol_BHV
            )


def _nccl_graph_worker(rank: int, world: int, port: int, error_dir: str) -> None:
    # a rank stuck in a collective says where, and exits, rather than hanging the launch
    hang_report = open(os.path.join(error_dir, f"rank{rank}.hang.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.dump_traceback_later(240, exit=True, file=hang_report)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    settings = AttentionConfig(block_size=64, last_q=64, dense_below=1024, cap=256)
    topo = build_topology(world)
    graph, graph_cache, eager_cache = PlanGraph(), BatchCache(), BatchCache()
    # two long documents a row, the same shapes again, one long document, then the first shapes again
    batches = (([3000, 500, 2600], 1), ([4000, 2100], 1), ([6100], 2), ([2000, 4100], 2))
    for lengths, num_captures in batches:
        seq_len = padded_length(sum(lengths), "stripe", world, 64)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None].to(device)
        token_layout = TokenLayout("stripe", world, 64, seq_len)
        index = token_layout.positions(rank).to(device)
        for seed in (0, 1):  # two layers of one batch
            gen = torch.Generator().manual_seed(seed + len(lengths))
            q = torch.randn(1, 8, seq_len, 64, generator=gen).to(device, torch.bfloat16)[:, :, index]
            k = torch.randn(1, 2, seq_len, 64, generator=gen).to(device, torch.bfloat16)[:, :, index]
            args = (q, k, doc[:, index], token_layout, topo, 0.125, settings, "triton")
            graphed, graphed_pattern = plan_ring(*args, graph_cache, graph)
            eager, eager_pattern = plan_ring(*args, eager_cache)
            assert graph.num_captures == num_captures, lengths
            for name in ("vertical_BHV", "slash_BHL", "recall_BH"):
                assert torch.equal(getattr(graphed_pattern, name), getattr(eager_pattern, name)), name
            for source, pairs in eager.pairs_by_source.items():
                for got, want in zip(graphed.pairs_by_source[source], pairs, strict=True):
                    for name in ("delta_BHL", "delta_bitmap_BHX", "vcol_BHV", "row_BHM6", "col_BHN6"):
                        assert torch.equal(getattr(got.layout, name), getattr(want.layout, name)), name
                    assert got.layout.num_vertical.get() == want.layout.num_vertical.get()
    del graph  # its graphs hold NCCL work: gone before the communicator is
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_graphed_ring_plan_equals_eager_plan_under_nccl(tmp_path):
    """On GPUs the ring's plan, its NCCL all_reduces included, replays one CUDA graph per shape: pattern and every
    pair's layout equal the eager plan's bit for bit, on the layer that captures, a later layer, a second batch
    of the same shapes (no capture), another shape (a capture) and the first shapes again."""
    run_ranks(_nccl_graph_worker, 2, str(tmp_path), error_dir=tmp_path)


def _statistics_case(rank: int, world: int, port: int, kind: str, probe_windows: int = 1) -> None:
    _init_rank(rank, world, port)
    settings = replace(SETTINGS, probe_windows=probe_windows)
    lengths = [70, 23, 90, 33]
    seq_len = padded_length(sum(lengths), kind, world, BLOCK)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, seq_len, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, seq_len, 16, generator=gen, dtype=torch.float64)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None]
    rows = probe_rows(doc, settings)
    _, vertical_BHS, slash_BHS = probe_statistics(probe_queries(q, rows), k, rows, SCALE)

    layout = TokenLayout(kind, world, BLOCK, seq_len)
    index = layout.positions(rank)
    local_rows = probe_rows(doc, settings, keys_for=functools.partial(rank_probe_keys, layout, rank, BLOCK, doc.device))
    reduce = ring_reduce(None)
    probe_BHQD = reduce(probe_queries(q[:, :, index], local_rows))
    _, ring_vertical_BHS, ring_slash_BHS = probe_statistics(probe_BHQD, k[:, :, index], local_rows, SCALE, reduce)
    torch.testing.assert_close(ring_vertical_BHS, vertical_BHS, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ring_slash_BHS, slash_BHS, atol=1e-12, rtol=1e-12)
    assert float(slash_BHS.sum()) > 0 and float(vertical_BHS.sum()) > 0
    dist.barrier()
    dist.destroy_process_group()


# Each launch runs the cases of one world size in turn, each in its own process group: starting the processes is
# most of a case's time. Ring cases: (kind, ring, node size, engine); statistics cases: ("statistics", kind).
CASES_BY_WORLD = {
    1: [("stripe", 1, 1, "reference")],
    2: [
        ("stripe", 2, 2, "reference"),
        ("zigzag", 2, 2, "reference"),
        ("stripe", 2, 2, "triton"),  # the Triton kernels (interpreter) inside the ring
        ("zigzag", 2, 2, "reference", 2),  # two probe windows per long document
        ("stripe", 2, 2, "reference", 1, True),  # the ring estimates one head at a time
        ("statistics", "zigzag"),
    ],
    3: [
        ("stripe", 3, 3, "reference"),
        ("zigzag", 3, 3, "reference"),
        ("statistics", "stripe"),
        ("statistics", "zigzag", 2),  # two probe windows per long document
    ],
    4: [
        ("stripe", 4, 2, "reference"),  # hierarchical: a flat ring's pairs, as 2 declared nodes × 2
        ("zigzag", 4, 2, "reference"),
        ("stripe", 2, 2, "reference"),  # two independent rings of 2 (data parallel × context parallel)
    ],
}


def _cases_worker(rank: int, world: int, first_port: int, more_ports: list[int], cases: list[tuple]) -> None:
    for port, case in zip([first_port, *more_ports], cases, strict=True):
        try:
            if case[0] == "statistics":
                _statistics_case(rank, world, port, *case[1:])
            else:
                _ring_case(rank, world, port, *case)
        except Exception as exc:
            raise AssertionError(f"case {case}, rank {rank}") from exc


@pytest.mark.parametrize("world", sorted(CASES_BY_WORLD), ids=lambda w: f"world{w}")
def test_ring_equals_single_process(world, tmp_path):
    """Ring cases: outputs and dQ/dK/dV equal single-process attention on the same global pattern. Statistics
    cases, fp64: vertical and slash scores of the ring (each rank's partial sums over its keys, all_reduced)
    equal the single-process scores, for runs of keys that are tiles (stripe) or chunks (zigzag)."""
    cases = CASES_BY_WORLD[world]
    run_ranks(_cases_worker, world, [free_port() for _ in cases[1:]], cases, error_dir=tmp_path)

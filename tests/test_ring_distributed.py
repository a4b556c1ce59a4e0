"""The sparse ring under gloo with several processes equals single-process attention on the same global
pattern: outputs and dQ/dK/dV, packed multi-document rows, stripe and zigzag, W = 1..4, hierarchical 2 × 2;
and the distributed pattern estimate equals the single-process one (its partial statistics, summed over the
ranks, equal the single-process statistics)."""

from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring.cp_attention import plan_ring, ring_attention, ring_reduce
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.pattern import (
    estimate_pattern,
    probe_queries,
    probe_rows,
    probe_statistics,
)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world: int, port: int) -> None:
    # One intra-op thread per rank: the ranks already fill the cores, and MKL resolves a vector math function
    # (exp, ...) on its first call, which, run on several threads at once, can take a low-accuracy kernel for
    # one thread's chunk (pytorch/pytorch#188792: here exp off by 3e-9 relative, once every few runs).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _worker(
    rank: int, world: int, port: int, kind: str, ring: int, node_size: int, engine: str, error_dir: str
) -> None:
    try:
        if engine == "triton":
            os.environ["TRITON_INTERPRET"] = "1"
        _init_rank(rank, world, port)
        torch.manual_seed(0)
        lengths = [70, 23, 90, 33]
        seq_len = padded_length(sum(lengths), kind, ring, BLOCK)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, seq_len, 16, generator=gen)
        k, v = torch.randn(1, 2, seq_len, 16, generator=gen), torch.randn(1, 2, seq_len, 16, generator=gen)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None]

        # single process: pattern, layout, reference output and gradients
        pattern = estimate_pattern(q, k, doc, SCALE, SETTINGS)
        start, length = document_spans(doc)
        full = build_layout(pattern, start, length, seq_len, BLOCK, SETTINGS.dense_below)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference_attention(*leaves, full, doc, doc, SCALE)
        dout = torch.randn(ref_out.shape, generator=gen)
        ref_out.backward(dout)

        # this rank's shard through the ring
        token_layout = TokenLayout(kind, ring, BLOCK, seq_len)
        topo = build_topology(node_size, ring)  # world // ring independent rings (data-parallel replicas)
        index = token_layout.positions(topo.rank)
        local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
        plan, local_pattern = plan_ring(
            local[0].detach(),
            local[1].detach(),
            doc[:, index],
            token_layout,
            topo,
            SCALE,
            SETTINGS,
            engine,
            BatchCache(),
        )
        assert torch.equal(local_pattern.vertical_BHV, pattern.vertical_BHV), "distributed verticals differ"
        assert torch.equal(local_pattern.slash_BHL, pattern.slash_BHL), "distributed slashes differ"
        torch.testing.assert_close(local_pattern.recall_BH, pattern.recall_BH, atol=1e-5, rtol=1e-5)
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
    except Exception:  # the parent reads this file: a failing rank must not hang the others silently
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.parametrize(
    "kind, world, ring, node_size, engine",
    [
        ("stripe", 1, 1, 1, "reference"),
        ("stripe", 2, 2, 2, "reference"),
        ("stripe", 3, 3, 3, "reference"),
        ("stripe", 4, 4, 4, "reference"),
        ("zigzag", 2, 2, 2, "reference"),
        ("zigzag", 3, 3, 3, "reference"),
        ("stripe", 4, 4, 2, "reference"),  # hierarchical: 2 declared nodes × 2 ranks
        ("zigzag", 4, 4, 2, "reference"),
        ("stripe", 4, 2, 2, "reference"),  # two independent rings of 2 (data parallel × context parallel)
        ("stripe", 2, 2, 2, "triton"),  # the Triton kernels (interpreter) inside the ring
    ],
)
def test_ring_equals_single_process(kind, world, ring, node_size, engine, tmp_path):
    try:
        mp.spawn(_worker, args=(world, _free_port(), kind, ring, node_size, engine, str(tmp_path)), nprocs=world)
    except Exception as exc:
        reports = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt")))
        pytest.fail(f"{exc}\n{reports}")


def _statistics_worker(rank: int, world: int, port: int, kind: str, error_dir: str) -> None:
    try:
        _init_rank(rank, world, port)
        lengths = [70, 23, 90, 33]
        seq_len = padded_length(sum(lengths), kind, world, BLOCK)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 4, seq_len, 16, generator=gen, dtype=torch.float64)
        k = torch.randn(1, 2, seq_len, 16, generator=gen, dtype=torch.float64)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None]
        rows = probe_rows(doc, SETTINGS)
        _, vertical_BHS, slash_BHS = probe_statistics(probe_queries(q, rows), k, rows, SCALE)

        index = TokenLayout(kind, world, BLOCK, seq_len).positions(rank)
        local_rows = probe_rows(doc, SETTINGS, key_pos_N=index)
        reduce = ring_reduce(None)
        probe_BHQD = reduce(probe_queries(q[:, :, index], local_rows))
        _, ring_vertical_BHS, ring_slash_BHS = probe_statistics(probe_BHQD, k[:, :, index], local_rows, SCALE, reduce)
        torch.testing.assert_close(ring_vertical_BHS, vertical_BHS, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(ring_slash_BHS, slash_BHS, atol=1e-12, rtol=1e-12)
        assert float(slash_BHS.sum()) > 0 and float(vertical_BHS.sum()) > 0
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.parametrize("kind, world", [("stripe", 3), ("zigzag", 2)])
def test_ring_statistics_sum_to_single_process(kind, world, tmp_path):
    """fp64: vertical and slash scores of the ring (each rank's partial sums over its keys, all_reduced) equal
    the single-process scores, for runs of keys that are tiles (stripe) or chunks (zigzag)."""
    try:
        mp.spawn(_statistics_worker, args=(world, _free_port(), kind, str(tmp_path)), nprocs=world)
    except Exception as exc:
        reports = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.txt")))
        pytest.fail(f"{exc}\n{reports}")

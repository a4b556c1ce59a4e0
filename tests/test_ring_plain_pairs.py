"""The dense ring's library path: zigzag chunk pairs that one document covers (in every batch row) run the library
contract (plain torch here, cuDNN on GPU), the pairs that document boundaries cut run our kernels, and together
they equal single-process dense attention with the same document mask, forward and dQ/dK/dV, on packed
multi-document batches under gloo (2 and 4 ranks, flat and 2 × 2 hierarchical). A one-document row puts every
pair on the library path, one coalesced call per ring step; a packed row does not."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_ranks

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring import ring as ring_module
from mtrain_cli.attention.ring.cp_attention import plan_dense_ring, ring_attention
from mtrain_cli.attention.ring.plain_pairs import LibraryCall, library_calls, plain_backward, plain_forward
from mtrain_cli.attention.ring.ring_plan import step_geometries
from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import load_config
from mtrain_cli.parallel.context import ContextParallel, ParallelContext
from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.topology import RingTopology, build_topology
from mtrain_cli.train.parts import build_router

BLOCK, SCALE, CHUNK = 16, 0.3, 64  # zigzag chunks of 64 tokens: 2·W chunks per row


def _documents(rows: list[list[int]], seq_len: int) -> torch.Tensor:
    """[B, S] document ids of rows packed from these document lengths, padded with -1."""
    out = torch.full((len(rows), seq_len), -1, dtype=torch.long)
    for b, lengths in enumerate(rows):
        out[b, : sum(lengths)] = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return out


# Per world size: packed rows whose documents leave some zigzag chunk pairs plain in both rows and cut others
# (row 1 cuts pairs that row 0 alone would leave plain), and a one-document row.
PACKED = {2: [[150, 106], [40, 216]], 4: [[300, 150, 62], [100, 330, 50]]}


def _pairs(world: int, rank: int, source: int, doc_BS: torch.Tensor):
    layout = TokenLayout("zigzag", world, BLOCK, doc_BS.shape[1])
    start, length = document_spans(doc_BS)
    mine, theirs = layout.positions(rank), layout.positions(source)
    return step_geometries(
        layout, rank, source, doc_BS[:, mine], doc_BS[:, theirs], start[:, mine], length[:, mine], 2**62
    )


def test_one_document_steps_coalesce_into_one_library_call_each():
    world = 4
    doc_BS = torch.zeros(1, 2 * world * CHUNK, dtype=torch.long)
    whole, first, second = slice(0, 2 * CHUNK), slice(0, CHUNK), slice(CHUNK, 2 * CHUNK)
    for rank in range(world):
        for source in range(world):
            pairs = _pairs(world, rank, source, doc_BS)
            assert all(p.plain is not None for p in pairs)
            expected = {
                source == rank: LibraryCall(whole, whole, True),  # both chunks' causal pairs and the one between
                source < rank: LibraryCall(whole, first, False),  # both query chunks see the source's first chunk
                source > rank: LibraryCall(second, whole, False),  # the second query chunk sees both key chunks
            }[True]
            assert library_calls(pairs) == [expected], (rank, source)


def test_packed_rows_leave_cut_pairs_to_our_kernels():
    world = 4
    doc_BS = _documents(PACKED[world], 2 * world * CHUNK)
    flags = [p.plain for r in range(world) for s in range(world) for p in _pairs(world, r, s, doc_BS)]
    # plain: the diagonal pairs of chunks 0, 2, 3 and 5, and chunk 3 over chunk 2; the other 31 are cut
    assert len(flags) == 36 and flags.count("causal") == 4 and flags.count("full") == 1
    # rank 2 holds chunks 2 and 5: both diagonal pairs are plain, the pair between them is cut (documents differ),
    # so the diagonal stays two causal calls
    calls = library_calls(_pairs(world, 2, 2, doc_BS))
    assert sorted((c.q_slice.start, c.causal) for c in calls) == [(0, True), (CHUNK, True)]
    # a document covering the chunks in row 0 only is not enough: row 1 cuts chunk 0 of rank 0's pair (0, 0)
    assert _pairs(world, 0, 0, _documents([[300], [40, 472]], 2 * world * CHUNK))[0].plain is None


@pytest.mark.parametrize("causal", [True, False])
def test_plain_contract_equals_autograd(causal):
    """The reference engine's plain pair: merged into an earlier partial result, and its backward from the final
    lse and delta, equals autograd over both key chunks at once (GQA: 4 query heads, 2 K/V heads)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 32, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 64, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, 4, 32, 16, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    score = leaves[0] @ leaves[1].repeat_interleave(2, 1).transpose(-1, -2) * SCALE
    mask = torch.ones(32, 64, dtype=torch.bool)
    mask[:, 32:] = torch.ones(32, 32, dtype=torch.bool).tril() if causal else True
    want = score.masked_fill(~mask, -torch.inf).softmax(-1) @ leaves[2].repeat_interleave(2, 1)
    want.backward(dout)

    out, lse = torch.zeros(1, 4, 32, 16), torch.full((1, 4, 32), -torch.inf)
    older, newer = LibraryCall(slice(0, 32), slice(0, 32), False), LibraryCall(slice(0, 32), slice(32, 64), causal)
    for call in (older, newer):
        ks = call.k_slice
        plain_forward("reference", q, k[:, :, ks], v[:, :, ks], call, SCALE, out, lse)
    torch.testing.assert_close(out, want.detach().float(), atol=1e-6, rtol=1e-5)
    grads = (torch.zeros(1, 4, 32, 16), torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16))
    delta = (dout.float() * out).sum(-1)
    for call in (older, newer):
        ks = call.k_slice
        part = (grads[0], grads[1][:, :, ks], grads[2][:, :, ks])
        plain_backward("reference", q, k[:, :, ks], v[:, :, ks], None, lse, dout, delta, call, SCALE, part)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout, warned", [("auto", False), ("zigzag", False), ("stripe", True)])
def test_a_dense_run_on_stripe_says_its_pairs_run_our_kernels(layout, warned):
    """Dense training over cp resolves to zigzag; an explicit stripe is kept and warned about (console and the
    run's summary take the trainer's warnings)."""
    config = load_config("tiny", ["parallel.cp=2", f"parallel.layout={layout}"])
    topology = RingTopology(0, 2, 2, 0, None, None, None)
    pc = ParallelContext(2, 0, 1, 2, torch.device("cpu"), None, topology, config.parallel.layout, BLOCK)
    messages: list[str] = []
    build_router(config, pc, messages.append)
    assert config.parallel.layout == ("stripe" if warned else "zigzag")
    assert sum("parallel.layout stripe with attention.mode dense" in m for m in messages) == warned, messages


def _dense_document_attention(q, k, v, doc_BS, scale=SCALE):
    """The oracle (in q's dtype): causal attention within each document (padding, id -1, is one more document)."""
    G, S = q.shape[1] // k.shape[1], q.shape[2]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    allowed = causal & (doc_BS[:, :, None] == doc_BS[:, None, :])
    score = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scale
    return score.masked_fill(~allowed[:, None], -torch.inf).softmax(-1) @ v.repeat_interleave(G, 1)


def _count_dispatch() -> Counter:
    """Count what the ring runs: library calls and our kernels' pairs, forward and backward."""
    counts: Counter = Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in ("plain_forward", "plain_backward", "chunk_forward", "chunk_backward"):
        setattr(ring_module, name, counted(name, getattr(ring_module, name)))
    return counts


def _summed(counts: Counter, keys: list[str]) -> list[int]:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    total = torch.tensor([counts[key] for key in keys], device=device)
    dist.all_reduce(total)
    return total.tolist()


def _check_batch(rank, world, topo, doc_BS, counts: Counter) -> list[int]:
    """The dense ring through the router equals the fp64 oracle; -> [library pairs, cut pairs] over all ranks."""
    seq_len = doc_BS.shape[1]
    gen = torch.Generator().manual_seed(seq_len + doc_BS.shape[0])
    q = torch.randn(doc_BS.shape[0], 4, seq_len, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(doc_BS.shape[0], 2, seq_len, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _dense_document_attention(*leaves, doc_BS)
    want.backward(dout)

    index = TokenLayout("zigzag", world, BLOCK, seq_len).positions(topo.rank)
    local = [t[:, :, index].float().requires_grad_() for t in (q, k, v)]
    router = AttentionRouter(None, cp=ContextParallel(topo, "zigzag", BLOCK))
    counts.clear()
    with router, router.micro_batch():
        out = router.attention(torch.nn.Identity(), *local, doc_BS[:, index], SCALE)
        out.backward(dout[:, :, index].float())
    torch.testing.assert_close(out.double(), want[:, :, index].detach(), atol=2e-5, rtol=1e-4)
    for name, got, leaf in zip("qkv", local, leaves):
        torch.testing.assert_close(
            got.grad.double(), leaf.grad[:, :, index], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}"
        )
    token_layout = TokenLayout("zigzag", world, BLOCK, seq_len)
    plan = plan_dense_ring(
        doc_BS[:, index], token_layout, topo, tuple(q.shape[:2]), SCALE, "reference", q.device, BatchCache()
    )
    pairs = [p for chunk_pairs in plan.pairs_by_source.values() for p in chunk_pairs]
    plain = sum(p.plain is not None for p in pairs)
    return _summed(Counter(library=plain, cut=len(pairs) - plain), ["library", "cut"])


def _worker(rank: int, world: int, port: int, node_size: int) -> None:
    torch.set_num_threads(1)  # see tests/test_ring_distributed.py
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    topo = build_topology(node_size)
    counts = _count_dispatch()
    seq_len = 2 * world * CHUNK
    keys = ["plain_forward", "plain_backward", "chunk_forward", "chunk_backward"]

    library, cut = _check_batch(rank, world, topo, _documents(PACKED[world], seq_len), counts)
    calls = _summed(counts, keys)
    assert library > 0 and cut > 0, (library, cut)
    assert all(n > 0 for n in calls), dict(zip(keys, calls))

    library, cut = _check_batch(rank, world, topo, _documents([[seq_len]], seq_len), counts)
    assert cut == 0 and library == world * (2 * world + 1), (library, cut)  # every causal chunk pair
    # every ring step is one library call, forward and backward; our kernels run nothing
    assert [counts[key] for key in keys] == [world, world, 0, 0], dict(counts)
    dist.barrier()
    dist.destroy_process_group()


# 4 ranks as 2 nodes × 2: the pairs of a flat ring of 4 (they follow the token layout), visited in the
# hierarchical order
@pytest.mark.parametrize("world, node_size", [(2, 2), (4, 2)])
def test_dense_ring_with_library_pairs_equals_dense_attention(world, node_size, tmp_path):
    run_ranks(_worker, world, node_size, error_dir=tmp_path)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


def _cuda_worker(rank: int, world: int, port: int) -> None:
    """bf16 on GPUs, NCCL: the dense ring with cuDNN on its plain pairs against the same ring with every pair on
    our Triton kernels, both against fp32 attention of the same bf16 inputs (Qwen2.5-3B's heads: 16 / 2 × 128)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    topo = build_topology()
    counts = _count_dispatch()
    block, seq_len = 64, 4096
    doc_BS = _documents([[1500, 700, 1800], [2600, 1400]], seq_len).to(device)
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(2, 16, seq_len, 128, generator=gen, device=device).bfloat16()
    k, v = (torch.randn(2, 2, seq_len, 128, generator=gen, device=device).bfloat16() for _ in range(2))
    dout = torch.randn(q.shape, generator=gen, device=device).bfloat16()
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    scale = 128**-0.5
    want = _dense_document_attention(*leaves, doc_BS, scale)
    want.backward(dout.float())

    layout = TokenLayout("zigzag", world, block, seq_len)
    index = layout.positions(rank).to(device)
    plan = plan_dense_ring(doc_BS[:, index], layout, topo, (2, 16), scale, "triton", device, BatchCache())
    ours = dataclasses.replace(
        plan,
        pairs_by_source={
            s: [dataclasses.replace(p, plain=None) for p in pairs] for s, pairs in plan.pairs_by_source.items()
        },
    )
    errors = {}
    for name, ring_plan in (("library", plan), ("ours", ours)):
        counts.clear()
        local = [t[:, :, index].detach().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, ring_plan, topo)
        out.backward(dout[:, :, index])
        errors[name] = [_relative_error(out, want[:, :, index])] + [
            _relative_error(t.grad, leaf.grad[:, :, index]) for t, leaf in zip(local, leaves)
        ]
        if name == "library":
            num_library, num_kernel = _summed(counts, ["plain_forward", "chunk_forward"])
            assert num_library > 0 and num_kernel > 0, dict(counts)
    # bf16 tolerances (relative Frobenius error against fp32 on the same bf16 inputs): out 1e-2, dQ/dK/dV 2e-2;
    # the library path is no worse than twice ours plus 2e-3
    if rank == 0:
        print(f"relative errors (out, dq, dk, dv) vs fp32, {world} GPUs: {errors}", flush=True)
    for name, bound in zip(["out", "dq", "dk", "dv"], [1e-2, 2e-2, 2e-2, 2e-2]):
        lib, ours_error = errors["library"].pop(0), errors["ours"].pop(0)
        assert lib < bound and ours_error < bound and lib < 2 * ours_error + 2e-3, (name, lib, ours_error)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA GPUs")
def test_cudnn_pairs_match_our_kernels_on_gpus(tmp_path):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    run_ranks(_cuda_worker, world, error_dir=tmp_path)

"""Context-parallel geometry in one process: every (rank, source) pair of a stripe or zigzag layout,
merged by LSE and with gradients accumulated, equals single-process sparse attention on the same pattern.
Packed multi-document rows, GQA, both engines (Triton under the interpreter on CPU, and plain torch)."""

from __future__ import annotations

import functools

import pytest
import torch

from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring.cp_attention import rank_probe_keys
from mtrain_cli.attention.ring.ring_plan import step_pairs
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.chunk import chunk_backward, chunk_forward
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.pattern import estimate_pattern
from mtrain_cli.attention.sparse.reference import reference_attention
from mtrain_cli.parallel.layouts import TokenLayout, padded_length, shard_batch

BLOCK = 16
SCALE = 0.3


def global_inputs(seq_len: int, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, seq_len, 16, generator=gen)
    k, v = torch.randn(1, 2, seq_len, 16, generator=gen), torch.randn(1, 2, seq_len, 16, generator=gen)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    doc = torch.nn.functional.pad(doc, (0, seq_len - len(doc)), value=-1)[None]
    return q, k, v, doc


def rank_pairs(pattern, layout: TokenLayout, rank: int, source: int, doc, spans, dense_below: int):
    """The chunk pairs of rank `rank` against the K/V of rank `source`, from the global document ids and spans."""
    index_q, index_k = layout.positions(rank), layout.positions(source)
    start, length = spans
    return step_pairs(
        pattern,
        layout,
        rank,
        source,
        doc[:, index_q],
        doc[:, index_k],
        start[:, index_q],
        length[:, index_q],
        dense_below,
    )


def test_layouts_partition_the_sequence_and_pad():
    for kind, world in (("stripe", 3), ("zigzag", 2), ("stripe", 4)):
        length = padded_length(200, kind, world, BLOCK)
        assert length % (world * BLOCK) == 0 and length >= 200 and length - 200 < world * BLOCK * 2
        layout = TokenLayout(kind, world, BLOCK, length)
        assert torch.equal(layout.permutation().sort().values, torch.arange(length))
    layout = TokenLayout("stripe", 2, BLOCK, 64)
    assert layout.positions(1).tolist() == list(range(16, 32)) + list(range(48, 64))
    zig = TokenLayout("zigzag", 2, BLOCK, 64)
    assert zig.positions(0).tolist() == list(range(0, 16)) + list(range(48, 64))
    batch = {
        "input_ids": torch.arange(50)[None],
        "labels": torch.arange(50)[None],
        "position_ids": torch.arange(50)[None],
        "document_ids": torch.zeros(1, 50, dtype=torch.long),
    }
    shard = shard_batch(batch, layout, 1)
    assert shard["input_ids"][0, :16].tolist() == list(range(16, 32))
    assert shard["labels"][0, -14:].tolist() == [-100] * 14 and shard["document_ids"][0, -14:].tolist() == [-1] * 14


@pytest.mark.parametrize(
    "kind, world, engine",
    [("stripe", 3, "reference"), ("zigzag", 2, "reference"), ("stripe", 2, "triton"), ("zigzag", 2, "triton")],
)
def test_rank_pairs_equal_single_process(kind, world, engine):
    lengths = [70, 23, 90]
    seq_len = padded_length(sum(lengths), kind, world, BLOCK)
    q, k, v, doc = global_inputs(seq_len, lengths)
    settings = AttentionConfig(
        pattern="budget",
        num_vertical=4,
        num_slash=4,
        last_q=BLOCK,
        block_size=BLOCK,
        local_window=BLOCK,
        dense_below=40,
        num_sink=2,
    )
    pattern = estimate_pattern(q, k, doc, SCALE, settings)
    start, length = document_spans(doc)
    full = build_layout(pattern, start, length, seq_len, BLOCK, settings.dense_below)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, full, doc, doc, SCALE)
    dout = torch.randn_like(ref_out)
    ref_out.backward(dout)

    layout = TokenLayout(kind, world, BLOCK, seq_len)
    index = [layout.positions(r) for r in range(world)]
    outs, lses = {}, {}
    for r in range(world):
        out = torch.zeros(1, 4, layout.local_len, 16)
        lse = torch.full((1, 4, layout.local_len), -torch.inf)
        for src in range(world):
            for pair in rank_pairs(pattern, layout, r, src, doc, (start, length), settings.dense_below):
                chunk_forward(
                    engine,
                    q[:, :, index[r]][:, :, pair.q_slice],
                    k[:, :, index[src]][:, :, pair.k_slice],
                    v[:, :, index[src]][:, :, pair.k_slice],
                    pair.layout,
                    doc[:, index[r]][:, pair.q_slice],
                    doc[:, index[src]][:, pair.k_slice],
                    SCALE,
                    out[:, :, pair.q_slice],
                    lse[:, :, pair.q_slice],
                    pair.mask_bounds,
                )
        torch.testing.assert_close(out, ref_out[:, :, index[r]].detach(), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse[:, :, index[r]].detach(), atol=2e-5, rtol=1e-4)
        outs[r], lses[r] = out, lse

    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(world):
        dq = torch.zeros(1, 4, layout.local_len, 16)
        delta = (dout[:, :, index[r]] * outs[r]).sum(-1)
        for src in range(world):
            dk_src, dv_src = torch.zeros(1, 2, layout.local_len, 16), torch.zeros(1, 2, layout.local_len, 16)
            for pair in rank_pairs(pattern, layout, r, src, doc, (start, length), settings.dense_below):
                qs, ks = pair.q_slice, pair.k_slice
                chunk_backward(
                    engine,
                    q[:, :, index[r]][:, :, qs],
                    k[:, :, index[src]][:, :, ks],
                    v[:, :, index[src]][:, :, ks],
                    outs[r][:, :, qs],
                    lses[r][:, :, qs],
                    dout[:, :, index[r]][:, :, qs],
                    delta[:, :, qs],
                    pair.layout,
                    doc[:, index[r]][:, qs],
                    doc[:, index[src]][:, ks],
                    SCALE,
                    (dq[:, :, qs], dk_src[:, :, ks], dv_src[:, :, ks]),
                    pair.mask_bounds,
                )
            dk[:, :, index[src]] += dk_src
            dv[:, :, index[src]] += dv_src
        torch.testing.assert_close(dq, leaves[0].grad[:, :, index[r]], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dk, leaves[1].grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv, leaves[2].grad, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["stripe", "zigzag"])
def test_ring_estimate_is_deterministic_on_cuda(kind):
    """A ring rank's estimate (Triton probe kernels on its keys, slash scores gathered per run of keys) is
    the same bit for bit when run twice on the same input, scores and pattern; so is the one-process one."""
    from mtrain_cli.attention.sparse.pattern import probe_queries, probe_rows, probe_statistics

    device = torch.device("cuda")
    lengths = [3000, 500, 4100]
    world, block = 2, 64
    seq_len = padded_length(sum(lengths), kind, world, block)
    q, k, _, doc = global_inputs(seq_len, lengths)
    q, k, doc = q.to(device, torch.bfloat16), k.to(device, torch.bfloat16), doc.to(device)
    settings = AttentionConfig(block_size=block, last_q=64, dense_below=1024, cap=256)
    layout = TokenLayout(kind, world, block, seq_len)
    index = layout.positions(0)  # zigzag: chunks 0 and 3, apart
    keys_for = functools.partial(rank_probe_keys, layout, 0, block, device)
    for rows, q_r, k_r in (
        (probe_rows(doc, settings, keys_for=keys_for), q[:, :, index.to(device)], k[:, :, index.to(device)]),
        (probe_rows(doc, settings), q, k),
    ):
        for one, other in zip(*(probe_statistics(probe_queries(q_r, rows), k_r, rows, SCALE)[1:] for _ in range(2))):
            assert torch.equal(one, other)
        first, second = (estimate_pattern(q_r, k_r, doc, SCALE, settings, rows) for _ in range(2))
        assert torch.equal(first.vertical_BHV, second.vertical_BHV)
        assert torch.equal(first.slash_BHL, second.slash_BHL)
        assert torch.equal(first.recall_BH, second.recall_BH)


@pytest.mark.parametrize("kind, world", [("stripe", 3), ("zigzag", 2)])
def test_walked_blocks_bound_the_ring_plans_work(kind, world):
    """Training accounts a ring plan by the blocks its kernels walk (RingPlan.walked_blocks: no host read); exact
    work (RingPlan.work) also leaves out the vertical columns inside slash blocks. With verticals the bound is at
    least the work; with none (a slash-only pattern, the dense ring's) the two are equal."""
    from mtrain_cli.attention.ring.cp_attention import dense_pattern, plan_density
    from mtrain_cli.attention.ring.ring import RingPlan

    lengths = [70, 23, 90]
    seq_len = padded_length(sum(lengths), kind, world, BLOCK)
    q, k, _, doc = global_inputs(seq_len, lengths)
    start, length = document_spans(doc)
    layout = TokenLayout(kind, world, BLOCK, seq_len)
    index = [layout.positions(r) for r in range(world)]
    base = dict(pattern="budget", num_slash=4, last_q=BLOCK, block_size=BLOCK, local_window=BLOCK, dense_below=40)
    cases = [  # (pattern, dense_below, the bound is exact)
        (estimate_pattern(q, k, doc, SCALE, AttentionConfig(**base, num_vertical=6, num_sink=2)), 40, False),
        (estimate_pattern(q, k, doc, SCALE, AttentionConfig(**base, num_vertical=0, num_sink=0)), 40, True),
        (dense_pattern(1, 4, torch.device("cpu")), 2**62, True),
    ]
    slack = 0.0
    for pattern, dense_below, exact in cases:
        for r in range(world):
            pairs = {
                src: rank_pairs(pattern, layout, r, src, doc, (start, length), dense_below) for src in range(world)
            }
            plan = RingPlan(pairs, doc[:, index[r]], [doc[:, i] for i in index], SCALE, "reference")
            walked, work = float(plan.walked_blocks), float(plan.work)
            assert work > 0
            batch_heads, causal = q.shape[0] * q.shape[1], plan.causal_blocks()
            density = float(plan_density(plan, batch_heads, plan.walked_blocks))
            assert density == pytest.approx(walked / batch_heads / causal) and density <= 1
            # where verticals crowd short documents the bound passes the causal count; density stops at 1
            assert float(plan_density(plan, batch_heads, torch.tensor(2.0 * batch_heads * causal))) == 1.0
            if exact:
                assert walked == pytest.approx(work, rel=1e-12)
            else:
                assert walked >= work - 1e-9
                slack += walked - work
    assert slack > 0  # some vertical column sits inside a slash block: the bound is not the work itself


def test_a_ring_ranks_probe_keys_are_made_once_per_layout_rank_and_rows():
    """rank_probe_keys caches what probe_keys builds from the rank's positions and the widest rank's buffer row:
    the same keys, made once."""
    from dataclasses import fields

    from mtrain_cli.attention.sparse.probe_keys import probe_keys

    cpu = torch.device("cpu")
    layout = TokenLayout("zigzag", 2, 16, 256)
    keys = rank_probe_keys(layout, 1, 16, cpu, 8)
    assert rank_probe_keys(layout, 1, 16, cpu, 8) is keys
    assert rank_probe_keys(layout, 0, 16, cpu, 8) is not keys and rank_probe_keys(layout, 1, 16, cpu, 4).pad == 4
    widest = rank_probe_keys(layout, 0, 16, cpu, 8).width  # rank 0 holds chunks 0 and 3, rank 1 the adjacent 1, 2
    assert keys.widest == widest > keys.width
    built = probe_keys(layout.positions(1), layout.seq_len, 16, 8, cpu, widest)
    for field in fields(keys):
        got, want = getattr(keys, field.name), getattr(built, field.name)
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, field.name


@pytest.mark.parametrize("kind", ["stripe", "zigzag"])
def test_every_rank_sizes_its_probe_head_groups_by_the_widest_buffer_row(kind):
    """Zigzag's middle rank holds one run of keys and the others two, so their probe buffer rows differ in width:
    every rank's `widest` is the widest of them, the width head groups are sized by, so the ranks' reduces pair up."""
    from mtrain_cli.attention.ring.cp_attention import rank_probe_keys
    from mtrain_cli.parallel.layouts import TokenLayout

    layout = TokenLayout(kind, 3, 16, 16 * 6 * 2)
    keys = [rank_probe_keys(layout, rank, 16, torch.device("cpu"), 8) for rank in range(3)]
    assert {k.widest for k in keys} == {max(k.width for k in keys)}
    if kind == "zigzag":
        assert len({k.width for k in keys}) == 2  # the middle rank's row is narrower

"""Triton sparse kernels against the plain-torch reference built from the same layout.

On CPU the kernels run under TRITON_INTERPRET=1 (conftest.py) at small sizes, in fp32, against an fp64
reference; with a GPU the same tests run compiled, and the bf16/fp16 tests run too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.kernels import kernel_layout
from mtrain_cli.attention.sparse.kernels_bwd import sparse_backward
from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.pattern import SENTINEL, Pattern, estimate_pattern
from mtrain_cli.attention.sparse.reference import allowed_mask, reference_attention
from mtrain_cli.profile.synthetic import random_pattern

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16 if DEVICE.type == "cpu" else 64
SCALE = 0.3
# fp32 against fp64: exact arithmetic on CPU; compiled kernels multiply fp32 tiles in TF32 (10-bit mantissa)
ATOL = 2e-5 if DEVICE.type == "cpu" else 5e-3


def packed_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(DEVICE)


def qkv(B: int, H: int, Hk: int, S: int, D: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=gen).to(DEVICE, dtype) for h in (H, Hk, Hk)]


def estimated_layout(q, k, doc, settings: AttentionConfig, q_offset: int = 0, k_offset: int = 0):
    pattern = estimate_pattern(q, k, doc, SCALE, settings)
    start, length = document_spans(doc)
    return pattern, build_layout(pattern, start, length, k.shape[2], settings.block_size, settings.dense_below)


def settings(**overrides) -> AttentionConfig:
    base = dict(
        pattern="budget",
        num_vertical=5,
        num_slash=5,
        last_q=BLOCK,
        block_size=BLOCK,
        local_window=BLOCK,
        dense_below=3 * BLOCK,
        num_sink=2,
    )
    return AttentionConfig(**{**base, **overrides})


def check_against_reference(q, k, v, layout, doc_q, doc_k, atol=ATOL):
    out, lse = sparse_forward(q, k, v, layout, doc_q, doc_k, SCALE)
    dout = torch.randn_like(out)
    dq, dk, dv = sparse_backward(q, k, v, out, lse, dout, layout, doc_q, doc_k, SCALE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, layout, doc_q, doc_k, SCALE, torch.float64)
    ref_out.backward(dout.double())
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=atol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=atol, rtol=atol)
    for name, got, leaf in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        torch.testing.assert_close(got.double(), leaf.grad, atol=atol * 5, rtol=atol, msg=lambda m: f"{name}: {m}")
    return out, lse, (dq, dk, dv)


@pytest.mark.parametrize("case", ["packed_gqa_odd_length", "one_document_mha", "many_short_documents"])
def test_matches_reference(case):
    if case == "packed_gqa_odd_length":  # long, short (dense), long documents; length not a block multiple
        B, H, Hk, D, lengths = 1, 4, 2, 16, [5 * BLOCK + 3, 2 * BLOCK - 5, 4 * BLOCK + 7]
    elif case == "one_document_mha":
        B, H, Hk, D, lengths = 1, 2, 2, 32, [8 * BLOCK + 9]
    else:  # batch of two rows, documents crossing block boundaries everywhere
        B, H, Hk, D, lengths = 2, 2, 1, 16, [BLOCK + 3, 3 * BLOCK + 1, BLOCK - 7, 3 * BLOCK + 5]
    doc = packed_ids(lengths).expand(B, -1).clone()
    if B == 2:
        doc[1] = doc[0].flip(0)  # a different packing in the second row
    q, k, v = qkv(B, H, Hk, doc.shape[1], D)
    _, layout = estimated_layout(q, k, doc, settings())
    check_against_reference(q, k, v, layout, doc, doc)


def test_sub_tiles_match_reference():
    """Layout blocks twice the kernels' sub-tiles: every pass steps through a block in pieces (the GPU's
    128-wide blocks with 64- or 32-wide sub-tiles); packed documents and a ragged tail."""
    block = 2 * BLOCK
    doc = packed_ids([3 * block + 5, block - 3, 4 * block + 9])
    q, k, v = qkv(1, 4, 2, doc.shape[1], 16, seed=5)
    s = settings(block_size=block, last_q=block, local_window=block // 2, dense_below=2 * block, num_vertical=7)
    _, layout = estimated_layout(q, k, doc, s)
    check_against_reference(q, k, v, layout, doc, doc)


def test_random_pattern_matches_reference():
    S, H = 7 * BLOCK, 2
    q, k, v = qkv(1, H, 1, S, 16, seed=3)
    pattern = random_pattern(1, H, S, num_vertical=9, num_slash=6, local_window=3, device=DEVICE, seed=1)
    doc = torch.zeros(1, S, dtype=torch.int32, device=DEVICE)
    start, length = document_spans(doc)
    layout = build_layout(pattern, start, length, S, BLOCK, dense_below=0)
    check_against_reference(q, k, v, layout, doc, doc)


def document_causal_attention(q_BHSD, k_BHkSD, v_BHkSD, doc_BS, scale):
    """Dense attention, causal within each document, by SDPA's math path: the reference in any dtype on any device
    (mtrain's dense_attention takes FlexAttention on CUDA, which compiles no fp64 kernel)."""
    S = doc_BS.shape[1]
    allowed_BSS = torch.ones(S, S, dtype=torch.bool, device=doc_BS.device).tril() & (
        doc_BS[:, :, None] == doc_BS[:, None, :]
    )
    return F.scaled_dot_product_attention(
        q_BHSD, k_BHkSD, v_BHkSD, attn_mask=allowed_BSS[:, None], scale=scale, enable_gqa=True
    )


def test_full_pattern_equals_dense_causal_attention():
    """Every offset as a slash: the kernels must give dense causal attention with document masking."""
    lengths = [3 * BLOCK + 2, 4 * BLOCK - 1]
    doc = packed_ids(lengths)
    S, H = doc.shape[1], 4
    q, k, v = qkv(1, H, 2, S, 16, seed=5)
    pattern = Pattern(
        vertical_BHV=torch.full((1, H, 1), SENTINEL, dtype=torch.int32, device=DEVICE),
        slash_BHL=torch.arange(S, dtype=torch.int32, device=DEVICE).expand(1, H, S).contiguous(),
    )
    start, length = document_spans(doc)
    layout = build_layout(pattern, start, length, S, BLOCK, dense_below=0)
    out, lse = sparse_forward(q, k, v, layout, doc, doc, SCALE)
    dout = torch.randn_like(out)
    dq, dk, dv = sparse_backward(q, k, v, out, lse, dout, layout, doc, doc, SCALE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = document_causal_attention(*leaves, doc, SCALE)
    ref.backward(dout.double())
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=ATOL)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got.double(), leaf.grad, atol=5 * ATOL, rtol=5 * ATOL)


def test_layout_covers_every_chosen_pair():
    """Each (query, key) on a chosen vertical or slash, causal and in one document, is computed."""
    doc = packed_ids([6 * BLOCK + 5, 5 * BLOCK])
    S, H = doc.shape[1], 2
    q, k, _ = qkv(1, H, 1, S, 16, seed=7)
    pattern, layout = estimated_layout(q, k, doc, settings(dense_below=0))
    pos = torch.arange(S, device=DEVICE)
    offset_SS = pos[:, None] - pos[None, :]
    chosen = torch.zeros(1, H, S, S, dtype=torch.bool, device=DEVICE)
    for h in range(H):
        slashes = pattern.slash_BHL[0, h][pattern.slash_BHL[0, h] < SENTINEL].long()
        verticals = pattern.vertical_BHV[0, h][pattern.vertical_BHV[0, h] < SENTINEL].long()
        chosen[0, h] = torch.isin(offset_SS, slashes)
        chosen[0, h][:, verticals] = True
    causal_doc = (offset_SS >= 0) & (doc[0][:, None] == doc[0][None, :])
    wanted = chosen & causal_doc
    computed = allowed_mask(layout, doc, doc)
    assert bool((computed | ~wanted).all()), "a chosen pair is missing from the layout"
    assert not bool((computed & ~causal_doc).any()), "the layout lets a query see a future or foreign key"
    assert float(layout.density()) < 0.9  # the test pattern is really sparse


def _active_blocks_by_rows(layout) -> torch.Tensor:
    """Oracle: walk every row's work the way the kernels do (slash and dense blocks, then the slice of
    vertical columns, skipping those whose block offset is in the bitmap)."""
    r = layout.row_BHM6.long().cpu()
    bitmap, vcol = layout.delta_bitmap_BHX.cpu(), layout.vcol_BHV.long().cpu()
    B, H, nq = r.shape[:3]
    out = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                sl_lo, sl_hi, dn_lo, dn_hi, vt_lo, vt_hi = r[b, h, i].tolist()
                out[b, h] += (sl_hi - sl_lo) + (dn_hi - dn_lo)
                for t in range(vt_lo, vt_hi):
                    out[b, h] += (
                        bitmap[b, h, i - int(vcol[b, h, t]) // layout.block + layout.num_k_blocks - 1] == 0
                    ) / layout.block
    return out


def test_active_blocks_count_the_kernels_work():
    doc = packed_ids([7 * BLOCK + 5, 2 * BLOCK, 6 * BLOCK])
    S, H = doc.shape[1], 3
    q, k, _ = qkv(1, H, 1, S, 16, seed=5)
    s = settings(num_vertical=9, num_slash=6, local_window=BLOCK // 2)
    pattern, layout = estimated_layout(q, k, doc, s)
    start, length = document_spans(doc)
    layouts = [layout]
    for q_off, k_off, stride in ((4 * BLOCK, 0, 1), (BLOCK, 0, 2), (0, BLOCK, 2)):  # ring chunks
        rows = slice(q_off, None, None) if stride == 1 else None
        q_idx = torch.arange(S, device=DEVICE) if rows is None else torch.arange(q_off, S, device=DEVICE)
        if stride > 1:
            q_idx = torch.cat(
                [torch.arange(b, min(b + BLOCK, S), device=DEVICE) for b in range(q_off, S, stride * BLOCK)]
            )
        k_len = S - k_off if stride == 1 else len(range(k_off, S, stride * BLOCK)) * BLOCK
        layouts.append(
            build_layout(
                pattern,
                start[:, q_idx],
                length[:, q_idx],
                k_len,
                BLOCK,
                s.dense_below,
                q_offset=q_off,
                k_offset=k_off,
                stride=stride,
            )
        )
    for lay in layouts:
        torch.testing.assert_close(lay.active_blocks().double().cpu(), _active_blocks_by_rows(lay), atol=1e-9, rtol=0)
    assert float(layouts[0].active_blocks().min()) > 0


def test_key_chunks_with_offsets_and_merge_equal_one_pass():
    """The ring's use: keys in two chunks at global offsets, partial outputs merged by LSE, gradients split."""
    doc = packed_ids([3 * BLOCK + 4, 5 * BLOCK - 4])
    S, H = doc.shape[1], 2
    q, k, v = qkv(1, H, 1, S, 16, seed=11)
    s = settings(dense_below=0)
    pattern = estimate_pattern(q, k, doc, SCALE, s)
    start, length = document_spans(doc)
    full = build_layout(pattern, start, length, S, BLOCK, 0)
    out_ref, lse_ref = sparse_forward(q, k, v, full, doc, doc, SCALE)
    dout = torch.randn_like(out_ref)
    dq_ref, _dk_ref, _dv_ref = sparse_backward(q, k, v, out_ref, lse_ref, dout, full, doc, doc, SCALE)

    # queries: the second half; keys: first chunk, then second chunk (merged into the first's result)
    qs = 4 * BLOCK
    q2, doc_q, start_q, length_q = q[:, :, qs:], doc[:, qs:], start[:, qs:], length[:, qs:]
    chunks = [(0, 4 * BLOCK), (4 * BLOCK, S)]
    out = torch.zeros(1, H, S - qs, 16, device=DEVICE)
    lse = torch.full((1, H, S - qs), -torch.inf, device=DEVICE)
    layouts = []
    for lo, hi in chunks:
        lay = build_layout(pattern, start_q, length_q, hi - lo, BLOCK, 0, q_offset=qs, k_offset=lo)
        layouts.append(lay)
        sparse_forward(q2, k[:, :, lo:hi], v[:, :, lo:hi], lay, doc_q, doc[:, lo:hi], SCALE, out, lse)
    torch.testing.assert_close(out, out_ref[:, :, qs:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lse, lse_ref[:, :, qs:], atol=ATOL, rtol=ATOL)

    # backward against the full pass restricted to these queries
    dout2 = dout[:, :, qs:]
    delta = (dout2 * out).sum(-1)
    dq = torch.zeros_like(q2)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for (lo, hi), lay in zip(chunks, layouts):
        sparse_backward(
            q2,
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            out,
            lse,
            dout2,
            lay,
            doc_q,
            doc[:, lo:hi],
            SCALE,
            grads=(dq, dk[:, :, lo:hi], dv[:, :, lo:hi]),
            delta_BHS=delta,
        )
    torch.testing.assert_close(dq, dq_ref[:, :, qs:], atol=5 * ATOL, rtol=5 * ATOL)
    only_late = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*only_late, full, doc, doc, SCALE)
    ref_out[:, :, qs:].backward(dout2)
    torch.testing.assert_close(dk, only_late[1].grad, atol=5 * ATOL, rtol=5 * ATOL)
    torch.testing.assert_close(dv, only_late[2].grad, atol=5 * ATOL, rtol=5 * ATOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision_within_1e2_of_fp32(dtype, head_dim):
    doc = packed_ids([1500, 700, 2900])
    S = doc.shape[1]
    q, k, v = qkv(1, 8, 2, S, head_dim, dtype=dtype, seed=4)
    s = AttentionConfig(pattern="budget", num_vertical=64, num_slash=64, block_size=128, dense_below=1024)
    pattern = estimate_pattern(q, k, doc, SCALE, s)
    start, length = document_spans(doc)
    layout = build_layout(pattern, start, length, S, 128, s.dense_below)
    out, lse = sparse_forward(q, k, v, layout, doc, doc, SCALE)
    dout = torch.randn_like(out)
    grads = sparse_backward(q, k, v, out, lse, dout, layout, doc, doc, SCALE)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, layout, doc, doc, SCALE, torch.float32)
    ref.backward(dout.float())
    for got, want in zip((out, *grads), (ref, *(t.grad for t in leaves))):
        assert float((got.float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_is_deterministic_at_scale():
    """With thousands of programs in flight nothing may depend on their schedule: repeated backward passes are
    bit-identical (packed documents, so dense rows, slash rows and vertical columns all contribute). Only on a
    GPU: the interpreter runs programs one at a time, so on CPU this could not fail."""
    doc = packed_ids([9000, 3000, 300, 4084])
    S = doc.shape[1]
    q, k, v = qkv(1, 16, 2, S, 128, dtype=torch.bfloat16, seed=5)
    s = AttentionConfig(pattern="budget", num_vertical=256, num_slash=256, block_size=128, dense_below=1024)
    _, layout = estimated_layout(q, k, doc, s)
    out, lse = sparse_forward(q, k, v, layout, doc, doc, SCALE)
    dout = torch.randn_like(out)
    first = sparse_backward(q, k, v, out, lse, dout, layout, doc, doc, SCALE)
    for _ in range(3):
        again = sparse_backward(q, k, v, out, lse, dout, layout, doc, doc, SCALE)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


def _tile_visible(doc_q, doc_k, rows, keys, shift):
    """Brute force: every (row, key) pair of the tile is causal, inside both chunks and in one document."""
    Sq, Sk = doc_q.shape[0], doc_k.shape[0]
    r, c = rows[:, None], keys[None, :]
    inside = (r < Sq) & (c < Sk)
    same = doc_q[r.clamp(max=Sq - 1)] == doc_k[c.clamp(max=Sk - 1)]
    return bool((inside & same & (c <= r + shift)).all())


@pytest.mark.parametrize("q_start,k_start", [(0, 0), (40, 16), (16, 56), (150, 100)])
def test_tile_mask_bounds_skip_exactly_the_visible_tiles(q_start, k_start):
    """The per-block bounds that let kernels skip the element mask: on a packed row cut into a query chunk and
    a key chunk (ring offsets included), a tile skips it exactly when all its pairs are visible (brute force)."""
    from mtrain_cli.attention.sparse.kernels import tile_mask_bounds

    block, sub = 16, 8
    gen = torch.Generator().manual_seed(q_start + k_start)
    lengths = torch.randint(1, 70, (40,), generator=gen).tolist()
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    Sq, Sk = 150, 133
    doc_q, doc_k = ids[q_start : q_start + Sq], ids[k_start : k_start + Sk]
    shift = q_start - k_start  # key-local position of a query row: row + shift
    key_start, row_end = (t[0] for t in tile_mask_bounds(doc_q[None], doc_k[None], block, shift))
    skips = []
    for i in range(-(-Sq // block)):  # query-major walk (forward, dQ): whole query block × key sub-tile
        rows = torch.arange(i * block, (i + 1) * block)
        key_limit = min(i * block + shift, Sk - 1)
        for k_first in range(0, Sk + sub):  # every alignment, so an off-by-one in a bound shows
            skip = not (k_first + sub - 1 > key_limit or k_first < int(key_start[i]))
            assert skip == _tile_visible(doc_q, doc_k, rows, torch.arange(k_first, k_first + sub), shift)
            skips.append(skip)
    for j in range(-(-Sk // block)):  # key-major walk (dK/dV): whole key block × query sub-tile
        keys = torch.arange(j * block, (j + 1) * block)
        for q_first in range(0, Sq + sub):
            skip = not (j * block + block - 1 > q_first + shift or q_first + sub - 1 >= int(row_end[j]))
            assert skip == _tile_visible(doc_q, doc_k, torch.arange(q_first, q_first + sub), keys, shift)
            skips.append(skip)
    assert any(skips) and not all(skips)


def test_model_layout_views_are_read_in_place():
    """transformers hands attention [B, H, S, D] views of [B, S, H, D] projections. The kernels read them in
    place (TMA takes the strides) and write outputs and gradients in the same layout, so the model's transpose
    back is free. Packed documents, GQA: the same results as contiguous copies."""
    B, H, Hk, D = 1, 4, 2, 16
    doc = packed_ids([3 * BLOCK + 5, BLOCK - 3, 2 * BLOCK + 9])
    S = doc.shape[1]
    gen = torch.Generator().manual_seed(7)
    q_BSHD, k_BSHD, v_BSHD = (torch.randn(B, S, h, D, generator=gen).to(DEVICE) for h in (H, Hk, Hk))
    # [B, H, S, D] views, not contiguous, except k: a compiled rotary step may return it contiguous, unlike v
    views = [q_BSHD.transpose(1, 2), k_BSHD.transpose(1, 2).contiguous(), v_BSHD.transpose(1, 2)]
    copies = [t.contiguous() for t in views]
    _, layout = estimated_layout(copies[0], copies[1], doc, settings())
    assert all(kernel_layout(t) is t for t in views)  # nothing copied
    out_view, lse_view = sparse_forward(*views, layout, doc, doc, SCALE)
    out_copy, lse_copy = sparse_forward(*copies, layout, doc, doc, SCALE)
    assert out_view.transpose(1, 2).is_contiguous()  # the model's [B, S, H, D]
    torch.testing.assert_close(out_view, out_copy, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_view, lse_copy, atol=1e-6, rtol=1e-6)
    dout = torch.randn(B, S, H, D, generator=gen).to(DEVICE).transpose(1, 2)
    grads_view = sparse_backward(*views, out_view, lse_view, dout, layout, doc, doc, SCALE)
    grads_copy = sparse_backward(*copies, out_copy, lse_copy, dout.contiguous(), layout, doc, doc, SCALE)
    for got, want, view in zip(grads_view, grads_copy, views):
        assert got.stride() == view.stride()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    check_against_reference(*views, layout, doc, doc)

"""Forward pass: O and LSE of vertical-slash sparse attention (see kernels.py for the algorithm)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import (
    LN2,
    LOG2E,
    MaskBounds,
    configs,
    element_mask,
    merge_lse,
    provide_descriptor_scratch,
    prune_tiles,
    query_tile_needs_mask,
    tile_mask_bounds,
    work_ranges,
)
from mtrain_cli.attention.sparse.layout import BlockLayout


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, qk_scale):
    """One online-softmax update with raw scores s [M, N] (masked pairs -inf) and values v [N, D]; the
    running max m_i is in log2 units, so the scale folds into one multiply-add per score."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing yet: keep exp() finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _softmax_pair(acc, m_i, l_i, s_a, v_a, s_b, v_b, qk_scale):
    """_softmax_step over two tiles of keys at once: one running-max update and accumulator rescale for both, and
    two independent tiles in flight: half the rescales, and one tile's loads and matmul can overlap the other's."""
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s_a, 1), tl.max(s_b, 1)) * qk_scale)
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_a = tl.exp2(s_a * qk_scale - m_safe[:, None])
    p_b = tl.exp2(s_b * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p_a, 1) + tl.sum(p_b, 1)
    acc = acc * alpha[:, None] + tl.dot(p_a.to(v_a.dtype), v_a)
    acc = tl.dot(p_b.to(v_b.dtype), v_b, acc)
    return acc, m_new, l_i


@triton.jit
def _work_block(DELTA_bh, i, t, n_dense, dn_lo, sl_lo):
    """Key block of entry t of row i's work list: the dense range first, then the slash list's slice."""
    is_dense = t < n_dense
    delta = tl.load(DELTA_bh + sl_lo + t - n_dense, mask=t >= n_dense, other=0)
    return tl.where(is_dense, dn_lo + t, i - delta)


@triton.jit
def _masked_scores(s, q_pos, dq, offs_n, DOCK_b, Sk, keep=True):
    """Scores s [M, N] with invisible pairs at -inf (document ids of keys past the chunk: -3, never equal);
    all of them unless `keep`."""
    dk = tl.load(DOCK_b + offs_n, mask=offs_n < Sk, other=-3)
    return tl.where(element_mask(q_pos, dq, offs_n, dk, Sk) & keep, s, -float("inf"))


@triton.autotune(
    configs=configs(({"SUB_N": 128}, {"SUB_N": 64}), ((8, 3), (4, 3))),
    key=["HEAD_DIM", "BLOCK", "MERGE", "Sq", "Sk"],
    prune_configs_by=prune_tiles(warps_from_block=True),
    cache_results=True,  # persisted in Triton's cache by GPU target and shape: later runs skip the tuning
    restore_value=["O", "LSE"],
)
@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    DOCQ,
    DOCK,
    KSTART,
    DELTA,
    BITMAP,
    VCOL,
    ROW,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sob,
    soh,
    sos,
    slb,
    slh,
    sdqb,
    sdkb,
    sksb,
    sdlb,
    sdlh,
    sbmb,
    sbmh,
    svcb,
    svch,
    srb,
    srh,
    H,
    G,
    Sq,
    Sk,
    NKB,
    SHIFT,
    qk_scale,
    BLOCK: tl.constexpr,
    SUB_N: tl.constexpr,
    VCHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE: tl.constexpr,
):
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # late rows see the most blocks: launch them first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = i * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    dq = tl.load(DOCQ + b * sdqb + offs_m, mask=row_ok, other=-2)
    key_start = tl.load(KSTART + b * sksb + i)
    key_limit = tl.minimum(i * BLOCK + SHIFT, Sk - 1)  # keys past it: the diagonal, or past the chunk
    q_pos = offs_m + SHIFT  # query positions in key-local coordinates
    K_b = K + b * skb + hk * skh
    V_b = V + b * svb + hk * svh
    # TMA descriptors for the block walk: whole tiles at any row, zeros past the chunk (the mask keeps them out)
    k_desc = tl.make_tensor_descriptor(K_b, shape=[Sk, HEAD_DIM], strides=[sks, 1], block_shape=[SUB_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V_b, shape=[Sk, HEAD_DIM], strides=[svs, 1], block_shape=[SUB_N, HEAD_DIM])
    DOCK_b = DOCK + b * sdkb
    row = ROW + b * srb + h * srh + i * 6
    sl_lo, sl_hi, dn_lo, dn_hi, vt_lo, vt_hi = work_ranges(row)

    m_i = tl.full([BLOCK], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # One loop over the row's work list (dense range, then slash blocks), two blocks a step (`_softmax_pair`; an
    # odd list's last step repeats its block, all masked); masks only where tiles need them.
    DELTA_bh = DELTA + b * sdlb + h * sdlh
    n_dense = dn_hi - dn_lo
    n_work = n_dense + sl_hi - sl_lo
    for t in range(0, n_work, 2):
        kb_a = _work_block(DELTA_bh, i, t, n_dense, dn_lo, sl_lo)
        has_b = t + 1 < n_work
        # an odd list's last step: entry t again, masked below
        kb_b = _work_block(DELTA_bh, i, tl.minimum(t + 1, n_work - 1), n_dense, dn_lo, sl_lo)
        for sub in tl.static_range(BLOCK // SUB_N):
            first_a = kb_a * BLOCK + sub * SUB_N
            first_b = kb_b * BLOCK + sub * SUB_N
            k_a = k_desc.load([first_a, 0])
            v_a = v_desc.load([first_a, 0])
            k_b = k_desc.load([first_b, 0])
            v_b = v_desc.load([first_b, 0])
            s_a = tl.dot(q, tl.trans(k_a))
            s_b = tl.dot(q, tl.trans(k_b))
            if query_tile_needs_mask(key_limit, first_a, first_a + SUB_N - 1, key_start):
                s_a = _masked_scores(s_a, q_pos, dq, first_a + tl.arange(0, SUB_N), DOCK_b, Sk)
            if query_tile_needs_mask(key_limit, first_b, first_b + SUB_N - 1, key_start) | (t + 1 >= n_work):
                s_b = _masked_scores(s_b, q_pos, dq, first_b + tl.arange(0, SUB_N), DOCK_b, Sk, has_b)
            acc, m_i, l_i = _softmax_pair(acc, m_i, l_i, s_a, v_a, s_b, v_b, qk_scale)
    VCOL_bh = VCOL + b * svcb + h * svch
    BITMAP_bh = BITMAP + b * sbmb + h * sbmh
    for t0 in range(vt_lo, vt_hi, VCHUNK):
        offs_t = t0 + tl.arange(0, VCHUNK)
        in_slice = offs_t < vt_hi
        cols = tl.load(VCOL_bh + offs_t, mask=in_slice, other=0)
        covered = tl.load(BITMAP_bh + i - cols // BLOCK + NKB - 1, mask=in_slice, other=1)
        use = in_slice & (covered == 0)  # columns inside this row's slash blocks are done already
        k = tl.load(K_b + cols[:, None] * sks + offs_d[None, :], mask=use[:, None], other=0.0)
        v = tl.load(V_b + cols[:, None] * svs + offs_d[None, :], mask=use[:, None], other=0.0)
        dk = tl.load(DOCK_b + cols, mask=use, other=-3)
        mask = element_mask(q_pos, dq, cols, dk, Sk) & use[None, :]
        s = tl.where(mask, tl.dot(q, tl.trans(k)), -float("inf"))
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, qk_scale)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, -float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_ptrs = O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :]
    lse_ptrs = LSE + b * slb + h * slh + offs_m
    if MERGE:
        o_prev = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
        lse_prev = tl.load(lse_ptrs, mask=row_ok, other=-float("inf"))
        o, lse = merge_lse(o_prev, lse_prev, o, lse)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptrs, lse, mask=row_ok)


def _check(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, v_BHkSD: torch.Tensor, layout: BlockLayout) -> None:
    B, H, Sq, D = q_BHSD.shape
    if k_BHkSD.shape != v_BHkSD.shape or k_BHkSD.shape[0] != B or H % k_BHkSD.shape[1]:
        raise ValueError(f"bad shapes q {tuple(q_BHSD.shape)} k {tuple(k_BHkSD.shape)} v {tuple(v_BHkSD.shape)}")
    if D not in (16, 32, 64, 128) or min(t.stride(-1) for t in (q_BHSD, k_BHkSD, v_BHkSD)) != 1:
        raise ValueError("head dim must be 16/32/64/128 with a contiguous last dimension")
    if (Sq, k_BHkSD.shape[2]) != (layout.q_len, layout.k_len) or layout.row_BHM6.shape[:2] != (B, H):
        raise ValueError("layout was built for other lengths or heads")


def sparse_forward(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    layout: BlockLayout,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    scale: float,
    out_BHSD: torch.Tensor | None = None,
    lse_BHS: torch.Tensor | None = None,
    mask_bounds: MaskBounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, lse fp32). Given out (fp32) and lse, merges this chunk's partial result into them in place.
    mask_bounds: tile_mask_bounds(doc_q, doc_k, layout.block, layout.mask_shift), made here when not given."""
    _check(q_BHSD, k_BHkSD, v_BHkSD, layout)
    B, H, Sq, D = q_BHSD.shape
    merge = out_BHSD is not None
    if merge:
        if lse_BHS is None or out_BHSD.dtype != torch.float32:
            raise ValueError("merge mode needs an fp32 out and its lse")
    else:
        out_BHSD = torch.empty_like(q_BHSD)
        lse_BHS = torch.empty(B, H, Sq, dtype=torch.float32, device=q_BHSD.device)
    doc_q, doc_k = doc_q_BSq.to(torch.int32).contiguous(), doc_k_BSk.to(torch.int32).contiguous()
    if mask_bounds is None:
        mask_bounds = tile_mask_bounds(doc_q, doc_k, layout.block, layout.mask_shift)
    key_start_BM, _ = mask_bounds
    provide_descriptor_scratch()
    grid = (layout.num_q_blocks, B * H)
    _forward_kernel[grid](
        q_BHSD,
        k_BHkSD,
        v_BHkSD,
        out_BHSD,
        lse_BHS,
        doc_q,
        doc_k,
        key_start_BM,
        layout.delta_BHL,
        layout.delta_bitmap_BHX,
        layout.vcol_BHV,
        layout.row_BHM6,
        *q_BHSD.stride()[:3],
        *k_BHkSD.stride()[:3],
        *v_BHkSD.stride()[:3],
        *out_BHSD.stride()[:3],
        *lse_BHS.stride()[:2],
        doc_q.stride(0),
        doc_k.stride(0),
        key_start_BM.stride(0),
        *layout.delta_BHL.stride()[:2],
        *layout.delta_bitmap_BHX.stride()[:2],
        *layout.vcol_BHV.stride()[:2],
        *layout.row_BHM6.stride()[:2],
        H,
        H // k_BHkSD.shape[1],
        Sq,
        layout.k_len,
        layout.num_k_blocks,
        layout.mask_shift,
        scale * LOG2E,
        BLOCK=layout.block,
        VCHUNK=layout.vertical_chunk,
        HEAD_DIM=D,
        MERGE=merge,
    )
    return out_BHSD, lse_BHS

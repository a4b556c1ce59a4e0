"""Triton kernels that score the probe queries of pattern estimation (the torch version is probe.py's oracle).

Algorithm. The probe rows (W windows of R consecutive queries: probe_windows per long document, the last at its
end; Q = W·R rows per batch row and head) are scored against every key of this process with a causal,
same-document softmax. Nothing of size Q × S is kept but the probabilities themselves, written once in bf16 at each
key's column of a row (probe.ProbeKeys: runs of globally adjacent key tiles with R zero columns around each). bf16
halves the buffer's memory and traffic; what is summed from it is summed in fp32, each element rounded to nearest
(within 2^-8 of itself).
Three launches:
1. row maxima and exp-sums per key tile (online-softmax partials), combined in torch into each row's LSE (and,
   in a ring, across ranks by the caller's reduce);
2. p = exp(s - LSE): the store, the per-key column sums of each row block (summed over the blocks in torch:
   the vertical scores) and the per-tile row sums (block masses, for recall);
3. the slash scores: offset d sums p over every probe row at the key d tokens back. Row r of a window reads
   column c + r (the window's R rows see R consecutive keys at one offset), a coalesced read along d.
Launches 1 and 2 run one program per (key tile, batch · kv head, block of ROW_BLOCK probe rows), walking the G
query heads of its group (K read once per group and row block). A program none of whose rows sees a key of its
tile (a key after every row, or before every row's document) computes nothing and stores no probabilities: about
half of a long document's tiles for windows spread along it, and most of a packed row's. So the buffer is defined
only where its row sees the key, and in the zero columns: every reader masks by what the row sees (launch 3, and
pattern._covered_mass). Every output element is written by one program: deterministic.
More probe rows (more long documents, a larger last_q) are more programs, not a wider tile: a program's share
of the rows stays in registers and its keys go a whole tile at a time, whatever the batch. It steps through its
key tile in sub-tiles when [rows, keys] scores would not fit in shared memory.
Scores are in log2 units (the scale folds in log2 e), accumulated in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import INTERPRET, LOG2E
from mtrain_cli.errors import UserError

if TYPE_CHECKING:
    from mtrain_cli.attention.sparse.probe_keys import ProbeKeys, Reduce


ROW_BLOCK = 64  # probe rows a program scores (fewer when the batch has fewer)
PROBE_TILE_ELEMENTS = 8192  # most [probe rows, keys] scores a program holds per step
MAX_PROBE_ELEMENTS = 2**31  # the kernels address the probability buffer with int32 offsets
SLASH_BLOCK = 256  # offsets a program of the slash launch sums
SLASH_ROWS = 8  # probe rows it reads at once


@triton.jit
def _masked_scores(
    P_bh, K_b, pos, lo, offs_q, offs_n, key_pos, NQ, S, sks, qk_scale, HEAD_DIM: tl.constexpr, WIDEN: tl.constexpr
):
    """[rows, keys] scores of probe rows offs_q (at positions pos, their documents starting at lo) against local keys
    offs_n, at global positions key_pos (log2 units); -inf where a key is not visible.

    Half-precision tiles go to tensor cores with fp32 accumulation (their products are exact in fp32, as in
    the torch oracle). WIDEN (fp32 inputs, or the interpreter, whose half-precision dot is not exact)
    multiplies in IEEE fp32 instead: on H100 that is ~100× slower at these tile sizes."""
    offs_d = tl.arange(0, HEAD_DIM)
    probe = tl.load(P_bh + offs_q[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_q < NQ)[:, None], other=0.0)
    k = tl.load(K_b + offs_n[:, None] * sks + offs_d[None, :], mask=(offs_n < S)[:, None], other=0.0)
    if WIDEN:
        s = tl.dot(probe.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(probe, tl.trans(k))
    s = s * qk_scale
    visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] >= lo[:, None]) & (offs_n < S)[None, :]
    return tl.where(visible, s, -float("inf"))


@triton.jit
def _block_rows(POS_b, LO_b, offs_q, NQ, tile_start, BLOCK: tl.constexpr):
    """The row block's positions (-1: not a probe row, sees nothing) and document starts, and whether any of its
    rows sees a key of the tile starting at global position tile_start."""
    row_ok = offs_q < NQ
    pos = tl.load(POS_b + offs_q, mask=row_ok, other=-1)
    lo = tl.load(LO_b + offs_q, mask=row_ok, other=0)
    sees = (pos >= tile_start) & (lo < tile_start + BLOCK)
    return pos, lo, tl.max(sees.to(tl.int32), 0) > 0


# The probe rows' count (windows x rows a window, which follow the batch's long documents) and the strides made
# from it are not specialized on: one build serves every batch of more than 32 probe rows (see LIST_ALIGN in
# pattern.py)
PARTIALS_ROW_ARGS = ("sposb", "NQ")
MASS_ROW_ARGS = ("sposb", "slb", "slh", "sprb", "sprh", "NQ", "ROW_WIDTH")
SLASH_ROW_ARGS = ("sprb", "sprh", "sposb", "scb", "scw", "W", "R", "ROW_WIDTH")


@triton.jit(do_not_specialize=PARTIALS_ROW_ARGS)
def _probe_partials_kernel(
    P,
    K,
    POS,
    LO,
    TILE_START,
    MAX,
    SUM,
    spb,
    sph,
    skb,
    skh,
    sks,
    sposb,
    smb,
    smh,
    smq,
    H,
    G,
    NQ,
    S,
    qk_scale,
    QB: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WIDEN: tl.constexpr,
):
    t = tl.program_id(0)
    bhk = tl.program_id(1)
    Hk = H // G
    b = bhk // Hk
    hk = bhk % Hk
    offs_q = tl.program_id(2) * QB + tl.arange(0, QB)
    tile_start = tl.load(TILE_START + t)
    pos, lo, sees = _block_rows(POS + b * sposb, LO + b * sposb, offs_q, NQ, tile_start, BLOCK)
    for g in range(G):
        h = hk * G + g
        m = tl.full([QB], -float("inf"), tl.float32)
        total = tl.zeros([QB], tl.float32)
        if sees:
            p_bh = P + b * spb + h * sph
            k_bh = K + b * skb + hk * skh
            for sub in tl.static_range(BLOCK // SUB):  # key sub-tiles keep [QB, SUB] scores within shared memory
                offs_n = t * BLOCK + sub * SUB + tl.arange(0, SUB)
                key_pos = tile_start + sub * SUB + tl.arange(0, SUB)
                s = _masked_scores(p_bh, k_bh, pos, lo, offs_q, offs_n, key_pos, NQ, S, sks, qk_scale, HEAD_DIM, WIDEN)
                m_new = tl.maximum(m, tl.max(s, 1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                total = total * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
                m = m_new
        out = b * smb + h * smh + offs_q * smq + t
        tl.store(MAX + out, m, mask=offs_q < NQ)
        tl.store(SUM + out, total, mask=offs_q < NQ)


@triton.jit(do_not_specialize=MASS_ROW_ARGS)
def _probe_mass_kernel(
    P,
    K,
    POS,
    LO,
    TILE_START,
    TILE_COLUMN,
    LSE2,
    PROB,
    VERT,
    BMASS,
    spb,
    sph,
    skb,
    skh,
    sks,
    sposb,
    slb,
    slh,
    sprb,
    sprh,
    svb,
    svh,
    svr,
    smb,
    smh,
    smq,
    H,
    G,
    NQ,
    S,
    ROW_WIDTH,
    qk_scale,
    QB: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WIDEN: tl.constexpr,
):
    t = tl.program_id(0)
    bhk = tl.program_id(1)
    Hk = H // G
    b = bhk // Hk
    hk = bhk % Hk
    row_block = tl.program_id(2)
    offs_q = row_block * QB + tl.arange(0, QB)
    row_ok = offs_q < NQ
    tile_start = tl.load(TILE_START + t)
    tile_column = tl.load(TILE_COLUMN + t)
    pos, lo, sees = _block_rows(POS + b * sposb, LO + b * sposb, offs_q, NQ, tile_start, BLOCK)
    for g in range(G):
        h = hk * G + g
        lse2 = tl.load(LSE2 + b * slb + h * slh + offs_q, mask=row_ok, other=float("inf"))  # +inf: p = 0
        p_bh = P + b * spb + h * sph
        k_bh = K + b * skb + hk * skh
        block_mass = tl.zeros([QB], tl.float32)
        for sub in tl.static_range(BLOCK // SUB):
            offs_j = sub * SUB + tl.arange(0, SUB)  # within the tile
            offs_n = t * BLOCK + offs_j
            key_ok = offs_n < S
            column_mass = tl.zeros([SUB], tl.float32)
            if sees:
                key_pos = tile_start + offs_j
                s = _masked_scores(p_bh, k_bh, pos, lo, offs_q, offs_n, key_pos, NQ, S, sks, qk_scale, HEAD_DIM, WIDEN)
                p = tl.exp2(s - lse2[:, None])
                prob_ptrs = PROB + b * sprb + h * sprh + offs_q[:, None] * ROW_WIDTH + tile_column + offs_j[None, :]
                tl.store(prob_ptrs, p.to(PROB.dtype.element_ty), mask=row_ok[:, None] & key_ok[None, :])
                column_mass = tl.sum(p, 0)
                block_mass += tl.sum(p, 1)
            tl.store(VERT + b * svb + h * svh + row_block * svr + offs_n, column_mass, mask=key_ok)
        tl.store(BMASS + b * smb + h * smh + offs_q * smq + t, block_mass, mask=row_ok)


@triton.jit(do_not_specialize=SLASH_ROW_ARGS)
def _probe_slash_kernel(
    PROB,
    COL,
    POS,
    LO,
    OUT,
    sprb,
    sprh,
    sposb,
    scb,
    scw,
    sck,
    sob,
    soh,
    H,
    W,
    K,
    S,
    R,
    ROW_WIDTH,
    DB: tl.constexpr,
    RB: tl.constexpr,
):
    bh = tl.program_id(0)  # the heads of one block of offsets run together: they share its columns
    b = bh // H
    h = bh % H
    offs_d = tl.program_id(1) * DB + tl.arange(0, DB)
    offs_r = tl.arange(0, RB)
    slash = tl.zeros([DB], tl.float32)
    for w in range(W):
        # the window's last row sees the most offsets: none of this block's past its document's start
        end = tl.load(POS + b * sposb + w * R + R - 1)  # -1: not a window (no long document)
        start = tl.load(LO + b * sposb + w * R + R - 1)
        if tl.program_id(1) * DB <= end - start:
            for run in range(K):
                col = tl.load(COL + b * scb + w * scw + run * sck + offs_d, mask=offs_d < S, other=0)  # 0: no key
                for r0 in range(0, R, RB):
                    offs_q = w * R + r0 + offs_r
                    row_ok = r0 + offs_r < R
                    pos = tl.load(POS + b * sposb + offs_q, mask=row_ok, other=-1)
                    lo = tl.load(LO + b * sposb + offs_q, mask=row_ok, other=0)
                    # the key d tokens back lies in the row's document (a row that is not real, at -1, sees none)
                    seen = (col > 0)[None, :] & (pos[:, None] - offs_d[None, :] >= lo[:, None])
                    row_ptrs = PROB + b * sprb + h * sprh + offs_q * ROW_WIDTH + r0 + offs_r
                    p = tl.load(row_ptrs[:, None] + col[None, :], mask=seen, other=0.0)
                    slash += tl.sum(p.to(tl.float32), 0)
    tl.store(OUT + b * sob + h * soh + offs_d, slash, mask=offs_d < S)


def probe_mass(
    probe_BHQD: torch.Tensor,
    k_BHkND: torch.Tensor,
    pos_BQ: torch.Tensor,
    lo_BQ: torch.Tensor,
    keys: ProbeKeys,
    scale: float,
    reduce: Reduce,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (probabilities [B, H, Q, keys.width] bf16 at each key's column, defined where the row sees the key and
    zero in the buffer's zero columns, undefined elsewhere; vertical scores [B, H, N] fp32; block masses
    [B, H, Q, N / block] fp32).

    probe_BHQD: the probe queries (Q = W·R rows, window-major); pos_BQ: each row's global position (-1: not a
    probe row); lo_BQ: its document's first position; k_BHkND: this process's keys; reduce: combines the rows'
    softmax partials across the processes that share the sequence."""
    B, H, Q, D = probe_BHQD.shape
    Hk, N = k_BHkND.shape[1], k_BHkND.shape[2]
    if B * H * Q * keys.width >= MAX_PROBE_ELEMENTS:
        raise UserError(
            f"attention.max_probe_rows / last_q: {Q:,} probe rows against {keys.width:,} key columns make a probe "
            f"buffer of {B * H * Q * keys.width:,} elements in {B * H} batch row(s) × head(s), past the probe kernels' "
            "2^31: lower attention.max_probe_rows or attention.last_q, or spread the sequence over more GPUs"
        )
    block = keys.block
    num_tiles = -(-N // block)
    device = probe_BHQD.device
    probe_BHQD = probe_BHQD.contiguous()
    pos_BQ, lo_BQ = pos_BQ.to(torch.int32).contiguous(), lo_BQ.to(torch.int32).contiguous()
    QB = min(ROW_BLOCK, max(16, triton.next_power_of_2(Q)))
    num_row_blocks = -(-Q // QB)
    grid = (num_tiles, B * Hk, num_row_blocks)
    widen = INTERPRET or probe_BHQD.dtype == torch.float32
    sub = max(16, min(block, PROBE_TILE_ELEMENTS // QB))
    common = dict(QB=QB, BLOCK=block, SUB=sub, HEAD_DIM=D, WIDEN=widen, num_warps=4)
    tile_max = torch.empty(B, H, Q, num_tiles, dtype=torch.float32, device=device)
    tile_sum = torch.empty_like(tile_max)
    qk_scale = scale * LOG2E
    _probe_partials_kernel[grid](
        probe_BHQD,
        k_BHkND,
        pos_BQ,
        lo_BQ,
        keys.tile_start_T,
        tile_max,
        tile_sum,
        *probe_BHQD.stride()[:2],
        *k_BHkND.stride()[:3],
        pos_BQ.stride(0),
        *tile_max.stride()[:3],
        H,
        H // Hk,
        Q,
        N,
        qk_scale,
        **common,
    )
    row_max = reduce(tile_max.amax(-1, keepdim=True), "max")
    row_max_safe = torch.where(row_max == -torch.inf, 0.0, row_max)
    total = reduce((tile_sum * torch.exp2(tile_max - row_max_safe)).sum(-1))
    lse2_BHQ = torch.where(total > 0, row_max_safe.squeeze(-1) + torch.log2(total), torch.inf).contiguous()

    prob = torch.empty(B, H, Q, keys.width, dtype=torch.bfloat16, device=device)
    prob.index_fill_(3, keys.pad_columns_P, 0.0)  # the kernel writes every key's column (0 where not visible)
    vertical_BHRN = torch.empty(B, H, num_row_blocks, N, dtype=torch.float32, device=device)  # per row block
    block_mass = torch.empty(B, H, Q, num_tiles, dtype=torch.float32, device=device)
    _probe_mass_kernel[grid](
        probe_BHQD,
        k_BHkND,
        pos_BQ,
        lo_BQ,
        keys.tile_start_T,
        keys.tile_column_T,
        lse2_BHQ,
        prob,
        vertical_BHRN,
        block_mass,
        *probe_BHQD.stride()[:2],
        *k_BHkND.stride()[:3],
        pos_BQ.stride(0),
        *lse2_BHQ.stride()[:2],
        *prob.stride()[:2],
        *vertical_BHRN.stride()[:3],
        *block_mass.stride()[:3],
        H,
        H // Hk,
        Q,
        N,
        prob.stride(2),
        qk_scale,
        **common,
    )
    return prob, vertical_BHRN.sum(2), block_mass


def probe_slash(
    prob_BHQC: torch.Tensor, slash_col_BWKS: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor, R: int
) -> torch.Tensor:
    """-> [B, H, S] fp32: this process's slash scores, offset d summing each probe row's probability on the key
    d tokens back. prob_BHQC: `probe_mass`'s buffer (read only where the row sees the key); slash_col_BWKS: where
    window w's row 0 reads offset d in each run of keys (pattern.slash_columns; 0: nowhere), row r r columns on."""
    B, H, Q, _ = prob_BHQC.shape
    W, K, S = slash_col_BWKS.shape[1:]
    assert prob_BHQC.stride(3) == 1 and Q == W * R and slash_col_BWKS.stride(3) == 1
    pos_BQ, lo_BQ = pos_BQ.to(torch.int32).contiguous(), lo_BQ.to(torch.int32).contiguous()
    slash_BHS = torch.empty(B, H, S, dtype=torch.float32, device=prob_BHQC.device)
    _probe_slash_kernel[(B * H, triton.cdiv(S, SLASH_BLOCK))](
        prob_BHQC,
        slash_col_BWKS,
        pos_BQ,
        lo_BQ,
        slash_BHS,
        *prob_BHQC.stride()[:2],
        pos_BQ.stride(0),
        *slash_col_BWKS.stride()[:3],
        *slash_BHS.stride()[:2],
        H,
        W,
        K,
        S,
        R,
        prob_BHQC.stride(2),
        DB=SLASH_BLOCK,
        RB=min(SLASH_ROWS, triton.next_power_of_2(R)),
        num_warps=4,
    )
    return slash_BHS

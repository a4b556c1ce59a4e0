"""Block layout of a vertical-slash pattern: what each query block (and, transposed, each key block) computes.

A slash offset d covers, for query block i, key blocks i - a and (off the block grid) i - a - 1, where
a = floor((d - δ) / block) and δ = q_offset - k_offset. So the blocks a head computes are described by
one sorted list of block offsets Δ = i - j per head, the same for every row (shift invariance): row i
computes blocks i - Δ for the Δ inside [i - hi_i, i - lo_i], a contiguous range of the list, where
[lo_i, hi_i] are the key blocks the row may see (its first query's document start .. causal end). Key
block j is computed by rows j + Δ over a contiguous range too, which gives the key-major (transposed)
view the deterministic dK/dV pass walks, with no per-block index lists and no sort.

Rows whose first query sits in a short document (< dense_below) run dense over [lo_i, hi_i] instead.
Because documents are contiguous runs and offsets are whole blocks, the rows after key block j that
can see it all share one document, so the dense rows of a key block are one contiguous range as well.

Verticals are per-head sorted columns; row i reads the contiguous slice of them inside its key range
and skips, in-kernel, the columns its slash blocks already cover (a bitmap over Δ), so every (query, key)
pair is computed exactly once. Everything is built with searchsorted/scatter on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mtrain_cli.attention.sparse.pattern import SENTINEL, Pattern

# Columns per vertical chunk in the kernels (gathered K/V rows per step); the layout indexes chunks by it.
VERTICAL_CHUNK = 64


class HostCopy:
    """A small device tensor on its way to the host: copied without blocking when made, read (waiting only
    for that copy) when needed. Lists are sized by host-known bounds so that planning never stalls the
    stream; the backward reads the true vertical count long after the copy landed."""

    def __init__(self, value: torch.Tensor):
        self._ready = None
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = value

    def get(self):
        """The value as Python: a number for a 0-dim tensor, else a list."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass(frozen=True)
class BlockLayout:
    """Kernel-ready description of a sparse pattern for one (query chunk, key chunk) pair.

    Row-major (per query block i) fields drive forward and dQ; column-major (per key block j) fields
    drive the deterministic dK/dV pass. All int32 on the pattern's device."""

    block: int
    q_len: int
    k_len: int
    q_offset: int  # global position of the first query (a whole block)
    k_offset: int  # global position of the first key
    stride: int  # local block m sits at global block offset // block + stride * m (1: contiguous chunk)
    mask_shift: int  # kernels' element causality: key k_local visible to query q_local iff k_local <= q_local + shift
    vertical_chunk: int
    delta_BHL: torch.Tensor  # sorted block offsets i - j from slashes, SENTINEL-padded
    delta_bitmap_BHX: torch.Tensor  # int8 [.., NQB + NKB]: 1 where Δ + NKB - 1 is in the list
    vcol_BHV: torch.Tensor  # sorted vertical columns local to the key chunk, SENTINEL-padded
    row_BHM6: torch.Tensor  # per query block: slash lo/hi (list range), dense lo/hi (key blocks), vertical lo/hi
    col_BHN6: torch.Tensor  # per key block: slash lo/hi (list range), dense lo/hi (query blocks), vcol lo/hi
    vchunk_BHC2: torch.Tensor  # per vertical chunk: first and last query block that reads it
    num_vertical: HostCopy  # most real vertical columns of a head (vcol_BHV is padded to a host-known bound)

    @property
    def num_q_blocks(self) -> int:
        return self.row_BHM6.shape[2]

    @property
    def num_k_blocks(self) -> int:
        return self.col_BHN6.shape[2]

    def active_blocks(self) -> torch.Tensor:
        """Computed block pairs per (B, H), each vertical column outside the row's slash blocks counting as
        1/block of a block (columns inside them are skipped by the kernels)."""
        r = self.row_BHM6.long()
        pairs = ((r[..., 1] - r[..., 0]) + (r[..., 3] - r[..., 2])).sum(-1).float()
        # Vertical pairs = every column of every row's slice, less the (row, column) pairs a slash block
        # covers. Column c (local block b) is covered exactly in rows b + Δ, one per Δ of the head's list,
        # so the count walks [columns × Δ] (chunked for memory), not [rows × columns].
        in_slices_BH = (r[..., 5] - r[..., 4]).sum(-1)
        nq, V = self.num_q_blocks, self.num_vertical.get()
        real_delta_BHL = self.delta_BHL < SENTINEL
        num_delta = max(int(real_delta_BHL.sum(-1).max()), 1)  # accounting may wait for the device
        delta_BHL, real_delta_BHL = self.delta_BHL[..., :num_delta].long(), real_delta_BHL[..., :num_delta]
        covered_BH = torch.zeros_like(in_slices_BH)
        chunk = max(1, 2**24 // max(1, r.shape[0] * r.shape[1] * delta_BHL.shape[-1]))
        for lo in range(0, V, chunk):
            vcol_BHV = self.vcol_BHV[..., lo : lo + chunk].long()
            t_V = torch.arange(lo, lo + vcol_BHV.shape[-1], device=r.device)
            row_BHVL = vcol_BHV[..., None] // self.block + delta_BHL[..., None, :]
            ok_BHVL = (
                (vcol_BHV < SENTINEL)[..., None] & real_delta_BHL[..., None, :] & (row_BHVL >= 0) & (row_BHVL < nq)
            )
            row_flat = row_BHVL.clamp(0, nq - 1).flatten(2)
            slice_lo = r[..., 4].gather(2, row_flat).view_as(row_BHVL)
            slice_hi = r[..., 5].gather(2, row_flat).view_as(row_BHVL)
            in_slice = (t_V[:, None] >= slice_lo) & (t_V[:, None] < slice_hi)
            covered_BH += (ok_BHVL & in_slice).sum((-1, -2))
        return pairs + (in_slices_BH - covered_BH).float() / self.block

    def walked_blocks(self) -> torch.Tensor:
        """fp64 [2], summed over (B, H): the block pairs the kernels walk as tiles (slash and dense ranges), and the
        vertical columns they gather, in blocks (columns inside slash blocks too, which they load and mask). An upper
        bound of active_blocks() from the row ranges alone: a handful of kernels and no host read, so training
        can account every layer of every step this way."""
        sums_6 = self.row_BHM6.reshape(-1, 6).sum(0, dtype=torch.int64).double()
        return sums_6 @ _walk_weights(self.block, sums_6.device)

    @property
    def shift_blocks(self) -> int:
        """Row i sees local key blocks up to i + shift_blocks (causality at block level)."""
        return (self.q_offset - self.k_offset) // self.block // self.stride

    def causal_blocks(self) -> int:
        """Block pairs on or below the causal diagonal for one (batch row, head): the dense work."""
        rows_i = torch.arange(self.num_q_blocks)
        return int((rows_i + self.shift_blocks + 1).clamp(min=0, max=self.num_k_blocks).sum())

    def density(self) -> torch.Tensor:
        """Share of the causal block triangle the layout computes (0-dim fp32 tensor)."""
        return self.active_blocks().float().mean() / max(self.causal_blocks(), 1)


@functools.lru_cache(maxsize=8)
def _walk_weights(block: int, device: torch.device) -> torch.Tensor:
    """fp64 [6, 2]: a row's six ints -> (range blocks, vertical columns in blocks); made once per device."""
    weights = [[-1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0 / block], [0.0, 1.0 / block]]
    return torch.tensor(weights, dtype=torch.float64, device=device)


def _searchsorted(sorted_BHL: torch.Tensor, values_BHM: torch.Tensor, right: bool = False) -> torch.Tensor:
    return torch.searchsorted(sorted_BHL.contiguous(), values_BHM.to(sorted_BHL.dtype).contiguous(), right=right)


def _first_local_at_or_after(pos: torch.Tensor, offset: int, stride: int, block: int) -> torch.Tensor:
    """Smallest local index whose global position is >= pos, for a chunk of `stride`-spaced blocks."""
    global_block = torch.div(pos, block, rounding_mode="floor")
    local_block = -torch.div(offset // block - global_block, stride, rounding_mode="floor")  # ceil
    on_grid = local_block * stride + offset // block == global_block
    return torch.where(on_grid, local_block * block + pos % block, local_block * block)


@dataclass(frozen=True)
class LayoutGeometry:
    """The head- and pattern-independent half of a layout: which key blocks each query block may see and
    whether it runs dense, and the transposed ranges per key block. It depends only on the documents and
    the chunk geometry, so one batch computes it once for all of its layers (see ops.plan_sparse)."""

    block: int
    q_len: int
    k_len: int
    q_offset: int
    k_offset: int
    stride: int
    shift: int  # row i sees local key blocks up to i + shift
    mask_shift: int
    sparse_BM: torch.Tensor  # rows that run the pattern (the rest run dense or see nothing)
    dn_lo_BM: torch.Tensor
    dn_hi_BM: torch.Tensor
    col_sparse_BN: torch.Tensor  # key block j has sparse rows at all
    dnc_lo_BN: torch.Tensor
    dnc_hi_BN: torch.Tensor
    # What each layer looks up in its sorted lists, concatenated so one searchsorted serves each list
    # ("right" searches as "left" of value + 1): in the Δ list, per row the smallest and largest Δ it may use,
    # per key block the first and last sparse row minus j; in the verticals, per row its first visible key
    # and one past its last causal key, per key block its first and one-past-last key.
    delta_queries_BX: torch.Tensor  # [B, 2·nq + 2·nk]
    vcol_queries_BX: torch.Tensor  # [B, 2·nq + 2·nk]

    @property
    def num_q_blocks(self) -> int:
        return self.sparse_BM.shape[1]

    @property
    def num_k_blocks(self) -> int:
        return self.dnc_lo_BN.shape[1]


def layout_geometry(
    doc_start_BSq: torch.Tensor,
    doc_length_BSq: torch.Tensor,
    k_len: int,
    block: int,
    dense_below: int,
    q_offset: int = 0,
    k_offset: int = 0,
    stride: int = 1,
) -> LayoutGeometry:
    """Geometry of one (query chunk, key chunk) pair; arguments as for `build_layout`."""
    if q_offset % block or k_offset % block or stride < 1:
        raise ValueError(f"q_offset {q_offset} and k_offset {k_offset} must be multiples of block {block}")
    B, q_len = doc_start_BSq.shape
    device = doc_start_BSq.device
    nq, nk = -(-q_len // block), -(-k_len // block)
    offset_blocks = (q_offset - k_offset) // block  # global block distance of the two chunks' first blocks
    shift = offset_blocks // stride  # row i sees local key blocks up to i + shift
    # element causality inside visited block pairs: exact where global blocks can coincide; else every
    # visited pair lies strictly below the diagonal and the shift just has to let it through
    mask_shift = (shift if offset_blocks % stride == 0 else shift + 1) * block

    # Per query block: visible key blocks [lo, hi] and whether it runs dense.
    first_q_M = torch.arange(nq, device=device) * block
    row_start_BM = _first_local_at_or_after(doc_start_BSq[:, first_q_M], k_offset, stride, block).clamp(min=0)
    lo_BM = torch.div(row_start_BM, block, rounding_mode="floor")  # first visible key block, local
    rows_M = torch.arange(nq, device=device)
    hi_M = (rows_M + shift).clamp(max=nk - 1)
    hi_BM = hi_M.expand(B, nq)
    visible_BM = (lo_BM <= hi_BM) & (hi_BM >= 0)
    dense_BM = (doc_length_BSq[:, first_q_M] < dense_below) & visible_BM
    sparse_BM = ~dense_BM & visible_BM

    # Per key block j: the row on its diagonal, the last row whose document reaches it, and denseness.
    cols_N = torch.arange(nk, device=device)
    diag_N = cols_N - shift  # query block with the same global position as key block j
    last_BN = _searchsorted(lo_BM.contiguous(), cols_N.expand(B, nk).contiguous(), right=True) - 1
    last_BN = last_BN.clamp(max=nq - 1)
    dense_pad_BM = torch.cat([dense_BM, torch.zeros_like(dense_BM[:, :1])], dim=1)
    diag_ok_N = (diag_N >= 0) & (diag_N < nq)
    diag_dense_BN = dense_pad_BM[:, diag_N.clamp(0, nq)] & diag_ok_N & (last_BN >= diag_N)
    after_N = (diag_N + 1).clamp(min=0)  # first row strictly after key block j
    after_dense_BN = dense_pad_BM[:, after_N.clamp(max=nq)] & (last_BN >= after_N)
    first_BN = torch.where(diag_dense_BN, diag_N, after_N).expand(B, nk)
    dnc_hi = torch.where(after_dense_BN, last_BN + 1, torch.where(diag_dense_BN, diag_N + 1, first_BN))
    sp_first = torch.where(diag_dense_BN, after_N, diag_N.clamp(min=0))
    sp_last = torch.where(after_dense_BN, torch.minimum(last_BN, diag_N), last_BN)
    delta_queries_BX = torch.cat(
        [(rows_M - hi_M).expand(B, nq), rows_M - lo_BM + 1, sp_first - cols_N, sp_last - cols_N + 1], dim=1
    )
    vcol_queries_BX = torch.cat(
        [
            row_start_BM,
            ((rows_M + shift + 1) * block).expand(B, nq),
            (cols_N * block).expand(B, nk),
            ((cols_N + 1) * block).expand(B, nk),
        ],
        dim=1,
    )
    return LayoutGeometry(
        block,
        q_len,
        k_len,
        q_offset,
        k_offset,
        stride,
        shift,
        mask_shift,
        sparse_BM,
        torch.where(dense_BM, lo_BM, 0),
        torch.where(dense_BM, hi_BM + 1, 0),
        sp_last >= sp_first,
        first_BN,
        dnc_hi,
        delta_queries_BX.contiguous(),
        vcol_queries_BX.contiguous(),
    )


def build_layout(
    pattern: Pattern,
    doc_start_BSq: torch.Tensor,
    doc_length_BSq: torch.Tensor,
    k_len: int,
    block: int,
    dense_below: int,
    q_offset: int = 0,
    k_offset: int = 0,
    stride: int = 1,
) -> BlockLayout:
    """Layout of `pattern` for one (query chunk, key chunk) pair.

    A chunk is a run of blocks: local block m is global block offset // block + stride * m (stride 1: the
    contiguous chunk [offset, offset + len); stride W with offset r·block: rank r's share of a stripe
    layout). doc_start_BSq / doc_length_BSq: global start and length of each query's document
    (`document_spans` on the global sequence). Offsets are whole blocks; lengths may be anything."""
    geometry = layout_geometry(doc_start_BSq, doc_length_BSq, k_len, block, dense_below, q_offset, k_offset, stride)
    return layout_from_geometry(pattern, geometry)


class LayoutArrays(NamedTuple):
    """The device half of a BlockLayout (what a captured plan graph outputs)."""

    delta_BHL: torch.Tensor
    delta_bitmap_BHX: torch.Tensor
    vcol_BHV: torch.Tensor
    row_BHM6: torch.Tensor
    col_BHN6: torch.Tensor
    vchunk_BHC2: torch.Tensor
    num_vertical: torch.Tensor  # 0-dim: most real vertical columns of a head


def layout_from_geometry(pattern: Pattern, geo: LayoutGeometry) -> BlockLayout:
    return layout_from_arrays(geo, layout_arrays(pattern, geo))


def layout_from_arrays(geo: LayoutGeometry, arrays: LayoutArrays) -> BlockLayout:
    return BlockLayout(
        geo.block,
        geo.q_len,
        geo.k_len,
        geo.q_offset,
        geo.k_offset,
        geo.stride,
        geo.mask_shift,
        VERTICAL_CHUNK,
        *arrays[:-1],
        HostCopy(arrays.num_vertical),
    )


def layout_arrays(pattern: Pattern, geo: LayoutGeometry) -> LayoutArrays:
    B, H = pattern.slash_BHL.shape[:2]
    device = pattern.slash_BHL.device
    block, stride, shift, k_len = geo.block, geo.stride, geo.shift, geo.k_len
    nq, nk = geo.num_q_blocks, geo.num_k_blocks
    offset_blocks = (geo.q_offset - geo.k_offset) // block

    # Δ list: both global block offsets each slash touches that map to whole local offsets, deduplicated.
    d_BHL = pattern.slash_BHL.long()
    real_BHL = pattern.slash_BHL < SENTINEL
    a_BHL = torch.div(d_BHL, block, rounding_mode="floor")
    global_BHX = torch.cat([a_BHL, torch.where(d_BHL % block > 0, a_BHL + 1, a_BHL)], dim=-1) - offset_blocks
    on_grid_BHX = global_BHX % stride == 0
    cand_BHX = torch.div(global_BHX, stride, rounding_mode="floor")
    cand_BHX = torch.where(
        real_BHL.repeat(1, 1, 2) & on_grid_BHX & (cand_BHX > -nk) & (cand_BHX < nq), cand_BHX, SENTINEL
    )
    cand_BHX = cand_BHX.to(torch.int32).sort(-1).values  # int32 keys: half the radix passes of int64's
    dup_BHX = torch.zeros_like(cand_BHX, dtype=torch.bool)
    dup_BHX[..., 1:] = cand_BHX[..., 1:] == cand_BHX[..., :-1]
    delta_BHX = torch.where(dup_BHX, SENTINEL, cand_BHX).sort(-1).values
    delta_BHL = delta_BHX[..., : nq + nk - 1].contiguous()  # Δ ∈ (-nk, nq): a bound known on the host
    bitmap_BHX = torch.zeros(B, H, nq + nk, dtype=torch.int8, device=device)
    bitmap_BHX.scatter_(2, (delta_BHL.long() + nk - 1).clamp(max=nq + nk - 1), 1)
    bitmap_BHX[..., -1] = 0  # the trash slot for SENTINEL

    # Per query block: the slice of the Δ list inside its visible key blocks (sparse rows only); per key
    # block: its sparse rows' slice.
    sparse_B1M = geo.sparse_BM[:, None]
    found_BHX = _searchsorted(delta_BHL, geo.delta_queries_BX[:, None].expand(B, H, -1))
    sl_lo, sl_hi, csl_lo, csl_hi = found_BHX.split([nq, nq, nk, nk], dim=-1)
    sl_hi = torch.where(sparse_B1M, sl_hi, sl_lo)

    # Vertical columns, local to the key chunk, and each row's slice of them.
    vert_BHV = pattern.vertical_BHV.long()
    rel_block_BHV = torch.div(vert_BHV, block, rounding_mode="floor") - geo.k_offset // block
    vcol_BHV = torch.div(rel_block_BHV, stride, rounding_mode="floor") * block + vert_BHV % block
    keep_BHV = (rel_block_BHV >= 0) & (rel_block_BHV % stride == 0) & (vcol_BHV < k_len) & (vert_BHV < SENTINEL)
    vcol_BHV = torch.where(keep_BHV, vcol_BHV.to(torch.int32), SENTINEL).sort(-1).values
    found_BHX = _searchsorted(vcol_BHV, geo.vcol_queries_BX[:, None].expand(B, H, -1))
    vt_lo, vt_hi, cvt_lo, cvt_hi = found_BHX.split([nq, nq, nk, nk], dim=-1)
    vt_hi = torch.where(sparse_B1M, torch.maximum(vt_hi, vt_lo), vt_lo)
    row_BHM6 = torch.stack(
        [sl_lo, sl_hi, geo.dn_lo_BM[:, None].expand(B, H, nq), geo.dn_hi_BM[:, None].expand(B, H, nq), vt_lo, vt_hi],
        dim=-1,
    )

    # Per key block: its rows' slice of the Δ list, its dense rows, its vertical columns.
    csl_hi = torch.where(geo.col_sparse_BN[:, None], torch.maximum(csl_hi, csl_lo), csl_lo)
    col_BHN6 = torch.stack(
        [
            csl_lo,
            csl_hi,
            geo.dnc_lo_BN[:, None].expand(B, H, nk),
            geo.dnc_hi_BN[:, None].expand(B, H, nk),
            cvt_lo,
            cvt_hi,
        ],
        dim=-1,
    )

    # Vertical chunks for the column-parallel backward: rows from the first causal one to the last
    # whose slice starts at or before the chunk's last column.
    n_chunks = max(-(-vcol_BHV.shape[-1] // VERTICAL_CHUNK), 1)
    idx_C = torch.arange(n_chunks, device=device) * VERTICAL_CHUNK
    first_col_BHC = vcol_BHV[..., ::VERTICAL_CHUNK][..., :n_chunks]
    first_col_BHC = torch.cat(
        [first_col_BHC, first_col_BHC.new_full((B, H, n_chunks - first_col_BHC.shape[-1]), SENTINEL)], -1
    )
    row_lo_BHC = (torch.div(first_col_BHC, block, rounding_mode="floor") - shift).clamp(min=0, max=nq)
    last_idx_C = idx_C + VERTICAL_CHUNK - 1
    row_hi_BHC = _searchsorted(vt_lo.contiguous(), last_idx_C.expand(B, H, n_chunks), right=True) - 1
    vchunk_BHC2 = torch.stack([row_lo_BHC, row_hi_BHC], dim=-1)

    i32 = torch.int32
    return LayoutArrays(
        delta_BHL.to(i32).contiguous(),
        bitmap_BHX.contiguous(),
        vcol_BHV.to(i32).contiguous(),
        row_BHM6.to(i32).contiguous(),
        col_BHN6.to(i32).contiguous(),
        vchunk_BHC2.to(i32).contiguous(),
        (vcol_BHV < SENTINEL).sum(-1).max(),
    )

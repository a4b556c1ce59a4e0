"""Where a process's keys sit in a probe buffer row (`ProbeKeys`), and how partial probe statistics combine
over the processes that share a sequence (`Reduce`: the identity in one process, all_reduce in a ring).

A ring rank holds tiles of `block` keys, each contiguous in the global frame. A probe buffer row holds each
run of globally adjacent tiles with R zero columns before and after it (see probe.py); in one process the
keys are the whole row: one run, at column key + R. Built on the host, over the whole row, and the same for every
batch: made once per (length, block, R) in one process (`whole_row_keys`), per (layout, rank, block, R) in a ring.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Protocol

import torch


class Reduce(Protocol):
    """Combines a partial statistic over the processes that share a sequence, in place; returns it."""

    def __call__(self, partial: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor: ...


def one_process(partial: torch.Tensor, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """The reduce of a process that holds the whole sequence: nothing to combine."""
    return partial


@dataclass(frozen=True)
class ProbeKeys:
    """This process's keys in the global frame, and where a probe buffer row holds them."""

    block: int  # key tile of the kernels: `block` local keys, contiguous in the global frame
    pad: int  # R: zero columns before and after each run of adjacent tiles
    width: int  # columns of a probe buffer row
    widest: int  # the widest row of any process sharing the sequence: all of them size their head groups by it
    pos_N: torch.Tensor  # int64 global position of each local key
    column_N: torch.Tensor  # int64 buffer column of each local key
    tile_start_T: torch.Tensor  # int32 global position of each tile's first key
    tile_column_T: torch.Tensor  # int32 buffer column of each tile's first key
    pad_columns_P: torch.Tensor  # int64 the buffer's zero columns
    local_of_global_S: torch.Tensor  # int64 local index of each global key; -1 where another process holds it
    column_of_global_S: torch.Tensor  # int64 buffer column of each global key; 0 (a zero column) if not local
    run_start_U: torch.Tensor  # int64 global start, end (exclusive) and first column of each run, ascending
    run_end_U: torch.Tensor
    run_column_U: torch.Tensor
    max_runs: int  # most runs that R consecutive global keys meet

    @property
    def whole_row(self) -> bool:
        """One process holds every key: local and global frames coincide (the keys are distinct, ascending)."""
        return self.pos_N.shape[0] == self.local_of_global_S.shape[0]

    def to_global(self, local_BHN: torch.Tensor) -> torch.Tensor:
        """[B, H, S] global frame of a per-local-key statistic, zero on keys that other processes hold."""
        if self.whole_row:
            return local_BHN
        B, H = local_BHN.shape[:2]
        index_BHS = self.local_of_global_S.clamp(min=0).expand(B, H, -1)
        return torch.where(self.local_of_global_S >= 0, local_BHN.gather(2, index_BHS), 0.0)


def buffer_width(pos_N: torch.Tensor, block: int, pad: int) -> int:
    """Columns of a probe buffer row for keys at global positions pos_N (host, tiles of `block`): the keys, and
    `pad` zero columns before and after each run of globally adjacent tiles."""
    tile_start_T = pos_N[::block]
    num_runs = 1 + int((tile_start_T[1:] != tile_start_T[:-1] + block).sum())
    return pos_N.shape[0] + pad * (num_runs + 1)


def probe_keys(
    pos_N: torch.Tensor | None, seq_len: int, block: int, pad: int, device: torch.device, widest: int | None = None
) -> ProbeKeys:
    """pos_N: global positions of this process's keys, on the host, ascending (None: the whole row); widest: the
    widest buffer row of the processes sharing the sequence (None: this one's)."""
    pos_N = torch.arange(seq_len) if pos_N is None else pos_N.cpu().long()
    N = pos_N.shape[0]
    n_N = torch.arange(N)
    tile_start_T = pos_N[::block]
    assert torch.equal(pos_N, tile_start_T.repeat_interleave(block)[:N] + n_N % block), "tiles must be contiguous"
    T = tile_start_T.shape[0]
    new_run_T = torch.ones(T, dtype=torch.bool)
    new_run_T[1:] = tile_start_T[1:] != tile_start_T[:-1] + block
    run_of_T = new_run_T.cumsum(0) - 1
    tile_column_T = pad * (run_of_T + 1) + torch.arange(T) * block
    column_N = tile_column_T.repeat_interleave(block)[:N] + n_N % block
    first_tile_U = new_run_T.nonzero().squeeze(1)
    run_start_U, run_column_U = tile_start_T[first_tile_U], tile_column_T[first_tile_U]
    run_len_U = torch.diff(first_tile_U * block, append=torch.tensor([N]))
    run_end_U = run_start_U + run_len_U
    assert bool((run_start_U[1:] >= run_end_U[:-1]).all()), "keys must be in ascending global order"
    width = buffer_width(pos_N, block, pad)
    # the first run meeting [a, a + R) ends after a, so the others start before its end + R - 1
    max_runs = int((torch.searchsorted(run_start_U, run_end_U + pad - 1) - torch.arange(run_start_U.shape[0])).max())
    is_pad_C = torch.ones(width, dtype=torch.bool)
    is_pad_C[column_N] = False
    local_of_global_S = torch.full((seq_len,), -1, dtype=torch.long)
    local_of_global_S[pos_N] = n_N
    column_of_global_S = torch.zeros(seq_len, dtype=torch.long)
    column_of_global_S[pos_N] = column_N
    on = dict(device=device)
    return ProbeKeys(
        block,
        pad,
        width,
        width if widest is None else widest,
        pos_N.to(**on),
        column_N.to(**on),
        tile_start_T.to(torch.int32).to(**on),
        tile_column_T.to(torch.int32).to(**on),
        is_pad_C.nonzero().squeeze(1).to(**on),
        local_of_global_S.to(**on),
        column_of_global_S.to(**on),
        run_start_U.to(**on),
        run_end_U.to(**on),
        run_column_U.to(**on),
        max_runs,
    )


@functools.lru_cache(maxsize=8)
def whole_row_keys(seq_len: int, block: int, pad: int, device: torch.device) -> ProbeKeys:
    """`probe_keys` of a process that holds every key: the same for every batch of this length, so made once
    (building it costs host time and six device syncs). Read-only, like every ProbeKeys."""
    return probe_keys(None, seq_len, block, pad, device)

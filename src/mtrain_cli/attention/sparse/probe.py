"""Probe scoring for pattern estimation: the probe rows' softmax over this process's keys, reduced three ways.

`score_probes` returns, per batch row and head, the probabilities of the Q = W·R probe rows, the vertical
score of every key (column sums) and each row's mass per key block (for recall). On CUDA it runs the Triton
kernels of probe_kernels.py (two passes over K, nothing but the probabilities written at full size);
elsewhere, and as their test oracle, plain torch.

The keys may be a ring rank's share of the sequence (`ProbeKeys`): tiles of `block` keys, each contiguous
in the global frame. A probe buffer row holds each run of globally adjacent tiles with R zero columns
before and after it, so that a strided view shifting row r of a window by r columns turns each slash
offset into one column (`ProbeScores.slash_mass`) without mixing keys that are not neighbours. In one
process the keys are the whole row: one run, at column key + R. The softmax is global: row maxima and
sums are combined across processes by `reduce` (the identity in one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from mtrain_cli.attention.sparse.probe_kernels import probe_mass


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

    def to_global(self, local_BHN: torch.Tensor) -> torch.Tensor:
        """[B, H, S] global frame of a per-local-key statistic, zero on keys that other processes hold."""
        B, H = local_BHN.shape[:2]
        index_BHS = self.local_of_global_S.clamp(min=0).expand(B, H, -1)
        return torch.where(self.local_of_global_S >= 0, local_BHN.gather(2, index_BHS), 0.0)


def probe_keys(pos_N: torch.Tensor | None, seq_len: int, block: int, pad: int, device: torch.device) -> ProbeKeys:
    """pos_N: global positions of this process's keys, on the host, ascending (None: the whole row)."""
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
    width = N + pad * (run_start_U.shape[0] + 1)
    # the first run meeting [a, a + R) ends after a, so the others start before its end + R - 1
    max_runs = int((torch.searchsorted(run_start_U, run_end_U + pad - 1) - torch.arange(run_start_U.shape[0])).max())
    is_pad_C = torch.ones(width, dtype=torch.bool)
    is_pad_C[column_N] = False
    local_of_global_S = torch.full((seq_len,), -1, dtype=torch.long)
    local_of_global_S[pos_N] = n_N
    column_of_global_S = torch.zeros(seq_len, dtype=torch.long)
    column_of_global_S[pos_N] = column_N
    on = dict(device=device)
    return ProbeKeys(block, pad, width, pos_N.to(**on), column_N.to(**on), tile_start_T.to(torch.int32).to(**on),
                     tile_column_T.to(torch.int32).to(**on), is_pad_C.nonzero().squeeze(1).to(**on),
                     local_of_global_S.to(**on), column_of_global_S.to(**on), run_start_U.to(**on),
                     run_end_U.to(**on), run_column_U.to(**on), max_runs)


@dataclass(frozen=True)
class ProbeScores:
    prob_BHQC: torch.Tensor  # [B, H, Q, width]: row q holds p(key) at the key's column (ProbeKeys); zeros around
    vertical_BHN: torch.Tensor  # probe mass on each local key, summed over the probe rows
    block_mass_BHQT: torch.Tensor  # each probe row's mass per local key tile
    rows_per_window: int

    def slash_mass(self) -> torch.Tensor:
        """[B, H, W, width - R]: column c of window w sums its rows' p at column c + r (row r = the window's
        r-th probe), one slash offset of one run of keys (pattern.slash_columns says which). Row r is read r
        columns to the right through a strided view (row stride + 1): one coalesced pass, nothing copied."""
        B, H, Q, width = self.prob_BHQC.shape
        R = self.rows_per_window
        assert self.prob_BHQC.stride(3) == 1
        st = self.prob_BHQC.stride()
        diagonal_BHWRC = self.prob_BHQC.as_strided((B, H, Q // R, R, width - R),
                                                   (st[0], st[1], R * st[2], st[2] + 1, 1),
                                                   self.prob_BHQC.storage_offset())
        return diagonal_BHWRC.sum(3)


def score_probes_torch(probe_BHQD: torch.Tensor, k_BHkND: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor,
                       keys: ProbeKeys, scale: float, reduce: Reduce = one_process) -> ProbeScores:
    """Plain-torch scoring (fp32, or fp64 inputs in fp64): the CPU path and the oracle of the Triton kernels."""
    B, H, Q, D = probe_BHQD.shape
    Hk, N = k_BHkND.shape[1], k_BHkND.shape[2]
    dtype = torch.promote_types(probe_BHQD.dtype, torch.float32)
    score_BHQN = (probe_BHQD.to(dtype).reshape(B, Hk, H // Hk * Q, D) @ k_BHkND.to(dtype).transpose(-1, -2)).view(
        B, H, Q, N) * scale
    visible_BQN = (keys.pos_N <= pos_BQ[..., None]) & (keys.pos_N >= lo_BQ[..., None])
    score_BHQN.masked_fill_(~visible_BQN[:, None], -torch.inf)
    row_max_BHQ = reduce(score_BHQN.amax(-1), "max")
    exp_BHQN = torch.exp(score_BHQN - torch.where(row_max_BHQ == -torch.inf, 0.0, row_max_BHQ)[..., None])
    total_BHQ = reduce(exp_BHQN.sum(-1))
    prob_BHQN = exp_BHQN / torch.where(total_BHQ > 0, total_BHQ, 1.0)[..., None]
    T = -(-N // keys.block)
    block_mass_BHQT = torch.nn.functional.pad(prob_BHQN, (0, T * keys.block - N)).view(B, H, Q, T, keys.block).sum(-1)
    prob_BHQC = prob_BHQN.new_zeros(B, H, Q, keys.width).index_copy_(3, keys.column_N, prob_BHQN)
    return ProbeScores(prob_BHQC, prob_BHQN.sum(2), block_mass_BHQT, keys.pad)


def score_probes(probe_BHQD: torch.Tensor, k_BHkND: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor,
                 keys: ProbeKeys, scale: float, reduce: Reduce = one_process) -> ProbeScores:
    """pos_BQ: each probe row's global position, -1 for a row that is not real; lo_BQ: its document's start;
    k_BHkND: this process's keys (`keys` says where they are)."""
    if probe_BHQD.device.type == "cuda":
        prob, vertical, block_mass = probe_mass(probe_BHQD, k_BHkND, pos_BQ, lo_BQ, keys, scale, reduce)
        return ProbeScores(prob, vertical, block_mass, keys.pad)
    return score_probes_torch(probe_BHQD, k_BHkND, pos_BQ, lo_BQ, keys, scale, reduce)

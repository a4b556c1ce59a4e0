"""Pattern estimation across context-parallel ranks, with no rank doing the work while others wait.

Each rank holds a slice of the sequence (any token layout). The probe queries (the last queries of each
long document) live on whichever ranks own those positions: they are summed into every rank with one
all_reduce (each row is non-zero on its owner only). Every rank scores all probes against its own keys; the
softmax is made global with an all_reduce of row maxima and one of row sums; vertical scores (per key) and
slash scores (per offset) are partial sums over local keys, completed by all_reduce. Every rank then runs
the same selection on the same numbers, so all ranks agree on the pattern without a broadcast. Memory is
B·H·rows·S/W per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtrain_cli.attention.sparse.pattern import (Pattern, ProbeRows, SparseSettings, choose, probe_rows,
                                              slash_block_offsets)


def estimate_pattern_distributed(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, document_ids_BS: torch.Tensor,
                                 key_pos_S: torch.Tensor, scale: float, settings: SparseSettings,
                                 group: dist.ProcessGroup | None = None, rows: ProbeRows | None = None) -> Pattern:
    """q/k: this rank's tokens, at global positions key_pos_S; document_ids_BS: the whole (global) row;
    rows: its `probe_rows`, when the caller keeps them across layers."""
    B, H, S_loc, D = q_BHSD.shape
    Hk, S = k_BHkSD.shape[1], document_ids_BS.shape[1]
    device = q_BHSD.device
    key_pos_S = key_pos_S.to(device)
    if rows is None:
        rows = probe_rows(document_ids_BS, settings)
    pos_BWR, doc_start_BW, row_ok_BWR = rows.pos_BWR, rows.doc_start_BW, rows.row_ok_BWR
    W, R = pos_BWR.shape[1:]

    # probe queries, gathered by summation: each global row is non-zero on its owner only
    local_of_global = torch.full((S,), -1, dtype=torch.long, device=device)
    local_of_global[key_pos_S] = torch.arange(S_loc, device=device)
    local_BWR = local_of_global[pos_BWR]
    mine_N = (local_BWR >= 0).reshape(B, 1, W * R, 1)
    rows_BHND = q_BHSD.float().gather(2, local_BWR.clamp(min=0).reshape(B, 1, W * R, 1).expand(B, H, W * R, D))
    probe_BHND = torch.where(mine_N, rows_BHND, 0.0).contiguous()
    dist.all_reduce(probe_BHND, group=group)

    G = H // Hk
    score_BHWRS = (probe_BHND.reshape(B, Hk, G * W * R, D) @ k_BHkSD.float().transpose(-1, -2)).view(
        B, H, W, R, S_loc) * scale
    allowed_BWRS = ((key_pos_S <= pos_BWR[..., None]) & (key_pos_S >= doc_start_BW[..., None, None])
                    & row_ok_BWR[..., None])
    score_BHWRS.masked_fill_(~allowed_BWRS[:, None], -torch.inf)
    row_max_BHWR = score_BHWRS.amax(-1)
    dist.all_reduce(row_max_BHWR, op=dist.ReduceOp.MAX, group=group)
    finite_max = torch.where(torch.isinf(row_max_BHWR), 0.0, row_max_BHWR)
    prob_BHWRS = torch.exp(score_BHWRS - finite_max[..., None])
    row_sum_BHWR = prob_BHWRS.sum(-1)
    dist.all_reduce(row_sum_BHWR, group=group)
    prob_BHWRS /= torch.where(row_sum_BHWR > 0, row_sum_BHWR, 1.0)[..., None]

    vertical_score_BHS = torch.zeros(B, H, S, device=device)
    vertical_score_BHS[:, :, key_pos_S] = prob_BHWRS.sum((2, 3))
    offset_BWRS = (pos_BWR[..., None] - key_pos_S).clamp(min=0)  # masked pairs carry zero probability
    slash_score_BHS = torch.zeros(B, H, S, device=device)
    slash_score_BHS.scatter_add_(2, offset_BWRS.reshape(B, 1, -1).expand(B, H, -1), prob_BHWRS.reshape(B, H, -1))
    dist.all_reduce(vertical_score_BHS, group=group)
    dist.all_reduce(slash_score_BHS, group=group)

    vertical_BHV, slash_BHL = choose(vertical_score_BHS, slash_score_BHS, rows, settings)
    recall_BH = _recall(prob_BHWRS, pos_BWR, key_pos_S, vertical_BHV, slash_BHL, S, settings.block_size, group)
    return Pattern(vertical_BHV, slash_BHL, recall_BH)


def _recall(prob_BHWRS, pos_BWR, key_pos_S, vertical_BHV, slash_BHL, seq_len: int, block: int, group) -> torch.Tensor:
    """Share of the probe mass the layout computes: covered mass on local keys, summed over ranks."""
    B, H = prob_BHWRS.shape[:2]
    nb = -(-seq_len // block)
    device = prob_BHWRS.device
    delta_BHX = slash_block_offsets(slash_BHL, nb, block)
    block_offset_BWRS = (pos_BWR[..., None] // block - key_pos_S // block).clamp(min=0, max=nb)
    covered = delta_BHX.gather(2, block_offset_BWRS.reshape(B, 1, -1).expand(B, H, -1)).view_as(prob_BHWRS)
    is_vertical_BHS = torch.zeros(B, H, seq_len + 1, dtype=torch.bool, device=device)
    is_vertical_BHS.scatter_(2, vertical_BHV.long().clamp(max=seq_len), True)
    covered |= is_vertical_BHS[:, :, key_pos_S][:, :, None, None, :]
    sums_2BH = torch.stack([(prob_BHWRS * covered).sum((2, 3, 4)), prob_BHWRS.sum((2, 3, 4))])
    dist.all_reduce(sums_2BH, group=group)
    # no probed (long) document: every row runs dense and keeps all of its attention mass
    return torch.where(sums_2BH[1] > 0, sums_2BH[0] / sums_2BH[1].clamp(min=1e-30), 1.0)

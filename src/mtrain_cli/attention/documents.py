"""Documents of a packed batch: each token's document is the contiguous run of equal ids it sits in (what packing
writes; padding, id -1, is one more run; an id that comes back later starts a new document). Dense attention,
the sparse planner and the ring all find documents here."""

from __future__ import annotations

import torch


def document_spans(document_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (start_BS, length_BS) int64: the run of equal ids each token belongs to. A token's start is also its
    document's key: equal within a document, different between documents, non-decreasing along a row.

    Runs are found on the flattened batch (every row starts one) and each token looks its run up by binary search."""
    B, S = document_ids_BS.shape
    new_run_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    new_run_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    run_start_R = new_run_BS.flatten().nonzero().squeeze(1)  # flat positions, ascending
    flat_N = torch.arange(B * S, device=document_ids_BS.device)
    run_N = torch.searchsorted(run_start_R, flat_N, right=True) - 1
    next_start_R = torch.cat([run_start_R[1:], run_start_R.new_tensor([B * S])])
    start_N, end_N = run_start_R[run_N], next_start_R[run_N]
    return (start_N - flat_N // S * S).view(B, S), (end_N - start_N).view(B, S)

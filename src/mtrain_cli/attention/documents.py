"""Documents of a packed batch: each token's document is the contiguous run of equal ids it sits in (what packing
writes; padding, id -1, is one more run; an id that comes back later starts a new document). Dense attention,
the sparse planner and the ring all find documents here."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class HostDocuments:
    """A batch's whole rows' documents, read on the host before the upload: the plans of a batch then need no read
    of the device (it would wait for every kernel launched before it, and leave the GPU idle while the host goes
    on), and a ring needs no all_gather of the rows' ids."""

    shape: torch.Size  # [B, S] of the whole rows (not their ids: a batch's ids may be these very host ids, which
    # the cache would then keep alive)
    run_lengths: tuple[torch.Tensor, ...]  # each row's runs of equal ids (its documents, as document_spans finds them)
    on_device: torch.Tensor | None  # the whole rows' ids on the compute device (made where a ring needs them)

    @classmethod
    def of(cls, ids_BS: torch.Tensor, on_device: torch.Tensor | None = None) -> HostDocuments:
        run_lengths = tuple(torch.unique_consecutive(row_S, return_counts=True)[1] for row_S in ids_BS)
        return cls(ids_BS.shape, run_lengths, on_device)

    def longest(self) -> int:
        """Tokens of the longest document."""
        return max(int(lengths.max()) for lengths in self.run_lengths)

    def most_long(self, dense_below: int) -> int:
        """Most documents of at least dense_below tokens in a row."""
        return max(int((lengths >= dense_below).sum()) for lengths in self.run_lengths)

    def single_document(self) -> bool:
        """Every row is one run of ids."""
        return all(lengths.numel() == 1 for lengths in self.run_lengths)

"""A small cache for what attention derives from a batch's document ids alone (the same for all its layers).

Entries are keyed by the id tensor's identity and version and keep the tensor alive, so an identity can't be
reused while cached; only the last few batches are kept. Tensors made under `torch.inference_mode` (eval) have
no version counter; they are keyed by identity alone (outside inference mode they cannot change in place). The
attention router owns one; dense attention's document layout (dense.py), the single-process plan and its
kernels' tile mask bounds (sparse/ops.py) and the ring plan (ring/cp_attention.py) use it: a model's layers
share one batch, so all but the first hit. The trainer adds each batch's HostDocuments (documents.py), read on
the host before the upload, which those builders use instead of reading the device.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from mtrain_cli.attention.documents import HostDocuments

T = TypeVar("T")
MAX_ENTRIES = 8


class BatchCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[torch.Tensor | None, object]] = {}
        self._hosts: dict[tuple, tuple[weakref.ref, HostDocuments]] = {}  # held while the ids live

    def per_batch(self, document_ids: torch.Tensor | None, key: tuple, build: Callable[[], T]) -> T:
        """build() once per (document-id tensor, key); None ids (one document per row) are keyed by `key` alone."""
        full_key = (None if document_ids is None else (id(document_ids), _version(document_ids)), *key)
        hit = self._entries.get(full_key)
        if hit is not None and hit[0] is document_ids:
            return hit[1]
        value = build()
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.pop(next(iter(self._entries)))
        self._entries[full_key] = (document_ids, value)
        return value

    def add_host_documents(self, document_ids: torch.Tensor, host: HostDocuments) -> None:
        """`host`: the whole rows of the batch whose ids (or this rank's shard of them) are `document_ids`; kept
        until that tensor is freed (an identity is then free to be reused)."""
        key = (id(document_ids), _version(document_ids))
        self._hosts[key] = (weakref.ref(document_ids, lambda _: self._hosts.pop(key, None)), host)

    def host_documents(self, document_ids: torch.Tensor | None) -> HostDocuments | None:
        """What add_host_documents gave for these very ids, unchanged since; else None (read the device)."""
        if document_ids is None:
            return None
        hit = self._hosts.get((id(document_ids), _version(document_ids)))
        return hit[1] if hit is not None and hit[0]() is document_ids else None

    def host_rows(self, document_ids: torch.Tensor | None) -> HostDocuments | None:
        """host_documents when they are these very rows (not a ring rank's shard of them)."""
        host = self.host_documents(document_ids)
        return host if host is not None and host.shape == document_ids.shape else None


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version

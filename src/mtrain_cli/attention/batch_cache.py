"""A small cache for what attention derives from a batch's document ids alone (the same for all its layers).

Entries are keyed by the id tensor's identity and version and keep the tensor alive, so an identity can't be
reused while cached; only the last few batches are kept. Tensors made under `torch.inference_mode` (eval) have
no version counter; they are keyed by identity alone (outside inference mode they cannot change in place). The
attention router owns one; dense attention's document layout (dense.py), the single-process plan and its
kernels' tile mask bounds (sparse/ops.py) and the ring plan (ring/cp_attention.py) use it: a model's layers
share one batch, so all but the first hit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
MAX_ENTRIES = 8


class BatchCache:
    def __init__(self):
        self._entries: dict[tuple, tuple[torch.Tensor | None, object]] = {}

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


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version

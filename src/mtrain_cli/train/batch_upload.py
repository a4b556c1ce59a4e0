"""Batches from the host to the GPU: one copy from a pinned buffer kept across steps, without blocking the host;
and a training step's micro-batches from the loader to the device (StepFeed).

A pageable copy blocks the host while the driver stages it, and `pin_memory()` of each new tensor pays for
pinning again: in traces of 64K-token steps on one H100 the GPU waited ~6 ms between a dense step's per-tensor
uploads, far longer than the copies themselves. A batch's tensors (all int64 [B, S]) are stacked into one
pinned buffer, copied in one transfer and handed out as views. Each shape has `num_buffers` buffers, used in
turn; one is refilled once the transfer from it has finished (an event). The trainer fetches a step's batches
while the step before it runs and launches each step before reading the one before: the transfers of two steps'
micro-batches can wait behind running kernels, so it keeps two steps' worth, and a refill never waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention import AttentionRouter
from mtrain_cli.parallel import ParallelContext, shard_batch


@dataclass
class StepBatches:
    """A training step's micro-batches, fetched by the trainer during the step before, after its optimizer's
    launches: reading, counting and uploading them only once that step's results were read left the GPU idle
    4-60 ms before every 64K step on an H100 machine (the host's time on fresh host tensors varied from machine
    to machine), in both attention modes."""

    position: dict[str, int]  # the loader's position before these rows: a checkpoint's while they wait
    rows: list[dict[str, torch.Tensor]]  # on the host, as read (before any context-parallel sharding)
    num_tokens: int  # labelled tokens of the step, over every rank
    batches: list[dict[str, torch.Tensor]]  # this rank's micro-batches, on the device


class BatchUploader:
    def __init__(self, device: torch.device, num_buffers: int = 1):
        self.device, self.num_buffers = device, num_buffers
        # (names, dtype, shape) -> [(pinned [num_tensors, *shape], the event after its last transfer or None)]
        self._staging: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._turn: dict[tuple, int] = {}  # the buffer of each shape to fill next

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch on the device (the tensors of one dtype and shape, as the loader makes them)."""
        if self.device.type != "cuda":
            return {name: tensor.to(self.device) for name, tensor in batch.items()}
        names, first = list(batch), next(iter(batch.values()))
        assert all(t.dtype == first.dtype and t.shape == first.shape for t in batch.values()), "one dtype and shape"
        key = (tuple(names), first.dtype, tuple(first.shape))
        buffers = self._staging.setdefault(key, [])
        turn = self._turn.get(key, 0)
        self._turn[key] = (turn + 1) % self.num_buffers
        if turn == len(buffers):
            buffers.append((torch.empty((len(names), *first.shape), dtype=first.dtype, pin_memory=True), None))
        staging, copied = buffers[turn]
        if copied is not None:
            copied.synchronize()  # its last transfer may still be on its way to the GPU
        torch.stack(list(batch.values()), out=staging)
        on_device = staging.to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        buffers[turn] = (staging, copied)
        return dict(zip(names, on_device.unbind(0)))


class StepFeed:
    """A step's micro-batches: read, counted, sharded for this rank, uploaded (queued behind the GPU's work, if
    any), and their whole rows' documents given to the attention router."""

    def __init__(self, loader, pc: ParallelContext, router: AttentionRouter, grad_accum: int, device: torch.device):
        self.loader, self.pc, self.router, self.grad_accum = loader, pc, router, grad_accum
        self.upload = BatchUploader(device, num_buffers=2 * grad_accum)

    def fetch(self) -> StepBatches:
        position = self.loader.state_dict()
        rows = [next(self.loader) for _ in range(self.grad_accum)]
        # Average per labelled token over the whole step: all micro-batches, all ranks, all documents. Counted
        # on the host in the whole rows, which every rank of a ring reads: only data-parallel ranks' counts
        # differ. A collective here would hold each rank's host until the slowest one's arrives.
        num_tokens = sum(int((row["labels"] != -100).sum()) for row in rows)
        if self.pc.dp > 1:
            own = torch.tensor([num_tokens if self.pc.cp_rank == 0 else 0])
            num_tokens = int(self.pc.sum_all(own)[0])
        return StepBatches(position, rows, max(1, num_tokens), [self.to_device(row) for row in rows])

    def to_device(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tokens of the rows (context parallelism), uploaded. The router gets the whole rows'
        documents from the host: its plans would otherwise read them from the device, and a ring gather them."""
        if self.pc.cp == 1:
            batch = self.upload(rows)
            self.router.add_host_documents(batch["document_ids"], rows["document_ids"])
            return batch
        batch = self.upload(shard_batch(rows, self.pc.token_layout(rows["input_ids"].shape[1]), self.pc.cp_rank))
        whole = self.upload({"document_ids": rows["document_ids"]})["document_ids"]
        self.router.add_host_documents(batch["document_ids"], rows["document_ids"], whole)
        return batch

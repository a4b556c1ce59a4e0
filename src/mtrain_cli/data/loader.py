"""Deterministic, resumable, endless iteration over packed rows in micro-batches, shardable over data-parallel ranks.

Epoch e visits the rows in the order of a permutation seeded by (seed, e). Consecutive `batch_size` slices of that
order are the epoch's global batches (an incomplete last slice is skipped this epoch; the next permutation differs);
rank r of world_size takes global batches r, r + world_size, ... so ranks never share rows within an epoch.
The position is two integers, identical on every rank, so one rank's checkpoint resumes all of them.
"""

from __future__ import annotations

import numpy as np
import torch

from mtrain_cli.data.packing import PackedDataset
from mtrain_cli.errors import UserError


class SequenceLoader:
    """Yields dicts of int64 tensors [batch_size, seq_len]: input_ids, labels, position_ids, document_ids."""

    def __init__(
        self,
        packed: PackedDataset,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        assert 0 <= rank < world_size, f"rank {rank} outside world_size {world_size}"
        self.packed, self.batch_size, self.seed, self.shuffle = packed, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        if batch_size < 1:
            raise UserError(f"train.batch_size {batch_size} must be >= 1")
        self.num_batches_per_epoch = len(packed) // (batch_size * world_size)  # per rank
        if self.num_batches_per_epoch == 0:
            raise UserError(
                f"train.batch_size {batch_size} × {world_size} data-parallel rank(s) needs at least "
                f"{batch_size * world_size} packed training rows, but there are {len(packed)}; "
                f"add data, lower data.seq_len or lower train.batch_size"
            )
        self.epoch, self.index = 0, 0  # index: batches this rank has taken in this epoch
        self._order_epoch, self._order = -1, np.arange(0)

    def __iter__(self) -> SequenceLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.index == self.num_batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        global_batch = self.index * self.world_size + self.rank
        rows = self._epoch_order()[
            global_batch * self.batch_size : (global_batch + 1) * self.batch_size
        ]  # [batch_size]
        self.index += 1
        return self.packed.rows(rows)

    def state_dict(self) -> dict[str, int]:
        """The exact data position: the next batch is batch `index` of epoch `epoch` (after any roll-over)."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= self.num_batches_per_epoch:
            raise UserError(
                f"the checkpoint's data position (epoch {epoch}, batch {index}) does not fit this data "
                f"({self.num_batches_per_epoch} batches per epoch); resume with the same data.* and "
                f"train.batch_size settings"
            )
        self.epoch, self.index = epoch, index

    def _epoch_order(self) -> np.ndarray:
        """Row order of the current epoch [num_rows], computed once per epoch."""
        if self._order_epoch != self.epoch:
            num_rows = len(self.packed)
            self._order = (
                np.random.default_rng([self.seed, self.epoch]).permutation(num_rows)
                if self.shuffle
                else np.arange(num_rows)
            )
            self._order_epoch = self.epoch
        return self._order

"""From the recipe's data section to the trainer's loader: load → tokenize → pack → hold out → iterate."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from datasets import concatenate_datasets

from mtrain_cli.config import Config
from mtrain_cli.data import PackedDataset, SequenceLoader, load_text_dataset, pack_documents, tokenize_dataset
from mtrain_cli.errors import UserError


@dataclass
class TrainData:
    loader: SequenceLoader
    val: PackedDataset | None
    stats: dict[str, Any]


def _load_all(paths: list[str], text_field: str, tokenizer, num_proc: int):
    parts = [tokenize_dataset(load_text_dataset(p, text_field), tokenizer, text_field, num_proc) for p in paths]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def build_datasets(config: Config, tokenizer, dp_rank: int = 0, dp: int = 1) -> TrainData:
    """Rows are split over the data-parallel ranks by the loader (each takes every dp-th global batch)."""
    d = config.data
    tokens = _load_all(d.sources, d.text_field, tokenizer, d.num_proc)
    short = _load_all(d.short_sources, d.text_field, tokenizer, d.num_proc) if d.short_sources else None
    packed = pack_documents(
        tokens, d.seq_len, config.run.seed, short_ds=short, short_fraction=d.short_fraction, packing=d.packing
    )
    if len(packed) <= d.num_val_rows:
        raise UserError(
            f"data.num_val_rows {d.num_val_rows} leaves no training rows ({len(packed)} packed rows of "
            f"data.seq_len {d.seq_len}); add data or lower data.num_val_rows"
        )
    train, val = packed.split(len(packed) - d.num_val_rows)
    loader = SequenceLoader(train, config.train.batch_size, seed=config.run.seed, rank=dp_rank, world_size=dp)
    stats = asdict(packed.stats) | {"num_train_rows": len(train), "num_val_rows": len(val)}
    return TrainData(loader=loader, val=val if len(val) else None, stats=stats)

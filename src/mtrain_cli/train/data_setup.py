"""From the recipe's data section to the trainer's loader: load → tokenize (documents) or render (conversations)
→ pack → hold out → iterate."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import datasets

from mtrain_cli.config import Config
from mtrain_cli.data import (
    ChatCounts,
    PackedDataset,
    SequenceLoader,
    is_chat,
    load_text_dataset,
    pack_documents,
    tokenize_chat,
    tokenize_dataset,
)
from mtrain_cli.errors import UserError


@dataclass
class TrainData:
    loader: SequenceLoader
    val: PackedDataset | None
    stats: dict[str, Any]


def _load_all(paths: list[str], config: Config, tokenizer, chat: ChatCounts) -> list[datasets.Dataset]:
    """Each source tokenised: documents, or conversations rendered with the chat template (counted in `chat`)."""
    d = config.data
    parts = []
    for path in paths:
        ds = load_text_dataset(path, d.text_field)
        if not is_chat(ds):
            parts.append(tokenize_dataset(ds, tokenizer, d.text_field, d.num_proc))
            continue
        if d.packing != "best_fit":
            raise UserError(
                f"data source {path!r} holds conversations, which data.packing {d.packing} would cut at row "
                f"boundaries (an answer apart from its question); set data.packing=best_fit"
            )
        tokens = tokenize_chat(ds, tokenizer, path, d.seq_len, d.chat_turns, d.long_conversations, d.num_proc)
        chat.add(tokens)
        parts.append(tokens)
    return parts


def build_datasets(config: Config, tokenizer, dp_rank: int = 0, dp: int = 1) -> TrainData:
    """Rows are split over the data-parallel ranks by the loader (each takes every dp-th global batch)."""
    d = config.data
    chat = ChatCounts()
    tokens = _load_all(d.sources, config, tokenizer, chat)
    short = _load_all(d.short_sources, config, tokenizer, chat) if d.short_sources else None
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
    stats = asdict(packed.stats) | asdict(chat) | {"num_train_rows": len(train), "num_val_rows": len(val)}
    return TrainData(loader=loader, val=val if len(val) else None, stats=stats)

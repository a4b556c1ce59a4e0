"""Data pipeline: load local documents or conversations → tokenize (conversations: the chat template, the loss on
the assistant's tokens) → pack into document-aware rows → iterate deterministically."""

from mtrain_cli.data.chat import ChatCounts, is_chat, tokenize_chat
from mtrain_cli.data.loader import SequenceLoader
from mtrain_cli.data.packing import PackedDataset, PackingStats, pack_documents, tokenize_dataset
from mtrain_cli.data.sources import load_text_dataset

__all__ = [
    "ChatCounts",
    "PackedDataset",
    "PackingStats",
    "SequenceLoader",
    "is_chat",
    "load_text_dataset",
    "pack_documents",
    "tokenize_chat",
    "tokenize_dataset",
]

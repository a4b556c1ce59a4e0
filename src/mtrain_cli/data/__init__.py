"""Data pipeline: load local text → tokenize → pack into document-aware rows → iterate deterministically."""

from mtrain_cli.data.loader import SequenceLoader
from mtrain_cli.data.packing import PackedDataset, PackingStats, pack_documents, tokenize_dataset
from mtrain_cli.data.sources import load_text_dataset

__all__ = ["PackedDataset", "PackingStats", "SequenceLoader", "load_text_dataset", "pack_documents", "tokenize_dataset"]

"""Tokenise documents and pack them into fixed-length training rows that keep document boundaries.

Packing concatenates the documents, in a seeded shuffled order, into one token stream and cuts it into rows of
exactly `seq_len` tokens. Each row is an independent training sequence: a document cut by a row boundary (or
longer than `seq_len`) becomes several pieces, and every piece restarts its positions at 0 and gets its own
document id in its row, so attention and labels never cross a piece boundary. Only the last row is padded.
All per-token work is vectorised numpy over the whole stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from mtrain_cli.errors import UserError

IGNORE_INDEX = -100  # label of tokens that predict nothing (piece ends, padding)
PAD_TOKEN_ID = 0  # input id of padding; never attended (document id -1) and never labelled
PAD_DOCUMENT_ID = -1


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer, text_field: str = "text", num_proc: int = 1, append_eos: bool = True
) -> datasets.Dataset:
    """`ds` with one column `input_ids` (int32 token ids per document); every other column is dropped.

    Special tokens are added as the tokenizer does by default (e.g. Llama's BOS), then the EOS id is appended to
    each document unless it already ends with it. `datasets`' fingerprint cache makes re-runs free.
    """
    eos_token_id = tokenizer.eos_token_id if append_eos else None
    return ds.map(
        _tokenize_batch,
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        desc="tokenizing",
        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "eos_token_id": eos_token_id},
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
    )


def _tokenize_batch(batch: dict, tokenizer, text_field: str, eos_token_id: int | None) -> dict:
    encoded = tokenizer(batch[text_field], verbose=False)["input_ids"]
    if eos_token_id is not None:
        encoded = [ids if ids and ids[-1] == eos_token_id else ids + [eos_token_id] for ids in encoded]
    return {"input_ids": encoded}


@dataclass
class PackingStats:
    """What packing did. Token accounting: num_input_tokens == real tokens in rows + num_tokens_dropped."""

    num_documents: int
    num_input_tokens: int
    num_rows: int
    seq_len: int
    num_pad_tokens: int
    num_tokens_dropped: int  # short-mix tokens beyond the rows short_fraction asks for
    num_documents_split: int  # documents cut into 2+ pieces by row boundaries (all those longer than seq_len)
    num_short_rows: int  # rows made of short-context documents
    mean_documents_per_row: float  # document pieces per row
    tokens_per_second: float  # input tokens / wall time of pack_documents


@dataclass(eq=False)
class PackedDataset:
    """Packed rows as numpy arrays, each [num_rows, seq_len] int32; indexing gives torch int64 tensors."""

    input_ids: np.ndarray  # [num_rows, seq_len]
    labels: np.ndarray  # [num_rows, seq_len]: next token within the same piece, else IGNORE_INDEX
    position_ids: np.ndarray  # [num_rows, seq_len]: 0 at each piece start; 0 on padding
    document_ids: np.ndarray  # [num_rows, seq_len]: 0..k-1 per row, increasing; PAD_DOCUMENT_ID on padding
    stats: PackingStats

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One row: input_ids, labels, position_ids, document_ids as int64 tensors [seq_len]."""
        return {name: torch.from_numpy(array[index]).long() for name, array in self._arrays().items()}

    def rows(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows `indices` [batch] as int64 tensors [batch, seq_len]."""
        return {name: torch.from_numpy(array[indices]).long() for name, array in self._arrays().items()}

    def split(self, num_rows: int) -> tuple[PackedDataset, PackedDataset]:
        """The first `num_rows` rows and the rest (views, no copy); both keep the stats of the whole packing."""
        head = {name: array[:num_rows] for name, array in self._arrays().items()}
        tail = {name: array[num_rows:] for name, array in self._arrays().items()}
        return PackedDataset(**head, stats=self.stats), PackedDataset(**tail, stats=self.stats)

    def _arrays(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids,
            "labels": self.labels,
            "position_ids": self.position_ids,
            "document_ids": self.document_ids,
        }


@dataclass
class _PackedStream:
    """One stream (long or short documents) cut into rows, before mixing."""

    arrays: dict[str, np.ndarray]  # name -> [num_rows, seq_len]
    num_real_tokens: int
    num_documents: int
    num_documents_split: int


def pack_documents(
    token_ds: datasets.Dataset,
    seq_len: int,
    seed: int,
    *,
    short_ds: datasets.Dataset | None = None,
    short_fraction: float = 0.0,
) -> PackedDataset:
    """Pack tokenised documents (`input_ids` column) into rows of exactly `seq_len` tokens; deterministic in `seed`.

    With `short_ds` and 0 < `short_fraction` < 1, about that fraction of all rows is built from `short_ds`
    (packed the same way); short tokens beyond those rows are counted in `num_tokens_dropped`, and the rows
    are put in a seeded order so any tail split (validation) sees both kinds. The final partial row is padded,
    never dropped.
    """
    start = time.perf_counter()
    if int(seq_len) != seq_len or seq_len < 2:
        raise UserError(f"data.seq_len {seq_len!r} must be an integer >= 2; set a sequence length such as 2048")
    if not 0.0 <= short_fraction < 1.0:
        raise UserError(f"data.short_fraction {short_fraction} must be in [0, 1); e.g. 0.1 for 10% short rows")
    if short_fraction > 0 and short_ds is None:
        raise UserError(f"data.short_fraction {short_fraction} needs data.short_sources (local short documents)")
    long = _pack_stream(_read_documents(token_ds), seq_len, np.random.default_rng([seed, 0]))
    if long.num_real_tokens == 0:
        raise UserError("data.sources hold no tokens (every document is empty); pass documents with text")
    parts, num_dropped, num_short_rows = [long], 0, 0
    if short_ds is not None:
        short = _pack_stream(_read_documents(short_ds), seq_len, np.random.default_rng([seed, 1]))
        num_long_rows = len(long.arrays["input_ids"])
        num_short_rows = round(short_fraction * num_long_rows / (1.0 - short_fraction))
        num_available = len(short.arrays["input_ids"])
        if num_short_rows > num_available:
            raise UserError(
                f"data.short_fraction {short_fraction} needs {num_short_rows} rows of data.seq_len "
                f"{seq_len} from data.short_sources, which fill only {num_available}; add short "
                f"documents or lower data.short_fraction"
            )
        num_dropped = short.num_real_tokens - int((short.arrays["document_ids"][:num_short_rows] >= 0).sum())
        short.arrays = {name: array[:num_short_rows] for name, array in short.arrays.items()}
        parts.append(short)
    # Padding only ever ends a stream's last row.
    num_pad = sum(
        int((part.arrays["document_ids"][-1] == PAD_DOCUMENT_ID).sum())
        for part in parts
        if len(part.arrays["document_ids"])
    )
    arrays = _mix_rows(parts, np.random.default_rng([seed, 2]))
    num_rows = len(arrays["input_ids"])
    num_pieces = int((arrays["document_ids"].max(axis=1) + 1).sum())
    num_input_tokens = sum(part.num_real_tokens for part in parts)
    assert num_input_tokens == num_rows * seq_len - num_pad + num_dropped, "packing lost tokens"
    stats = PackingStats(
        num_documents=sum(part.num_documents for part in parts),
        num_input_tokens=num_input_tokens,
        num_rows=num_rows,
        seq_len=seq_len,
        num_pad_tokens=num_pad,
        num_tokens_dropped=num_dropped,
        num_documents_split=sum(part.num_documents_split for part in parts),
        num_short_rows=num_short_rows,
        mean_documents_per_row=num_pieces / num_rows,
        tokens_per_second=num_input_tokens / max(time.perf_counter() - start, 1e-9),
    )
    return PackedDataset(**arrays, stats=stats)


@dataclass
class _Documents:
    """Tokenised documents as read from arrow, zero-copy: token ids per arrow chunk, and where each document is."""

    chunk_tokens: list[np.ndarray]  # [num_chunk_tokens] per chunk
    chunk_of_document: np.ndarray  # [num_documents]
    start_in_chunk: np.ndarray  # [num_documents]
    lengths: np.ndarray  # [num_documents]


def _read_documents(token_ds: datasets.Dataset) -> _Documents:
    """The `input_ids` column, chunk by chunk (no concatenation: list offsets are int32 per chunk)."""
    assert "input_ids" in token_ds.column_names, "pack_documents needs the output of tokenize_dataset"
    column = token_ds.with_format("arrow")[:]["input_ids"]  # honours select/shuffle index mappings
    chunk_tokens, chunk_of_document, start_in_chunk, lengths = [], [], [], []
    for index, chunk in enumerate(column.chunks):
        assert chunk.null_count == 0, "input_ids holds null documents"
        chunk_lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
        chunk_starts = np.zeros(len(chunk_lengths), np.int64)
        np.cumsum(chunk_lengths[:-1], out=chunk_starts[1:])
        chunk_tokens.append(chunk.flatten().to_numpy(zero_copy_only=False))  # zero-copy for int columns
        chunk_of_document.append(np.full(len(chunk_lengths), index, np.int64))
        start_in_chunk.append(chunk_starts)
        lengths.append(chunk_lengths)
    empty = [np.zeros(0, np.int64)]
    return _Documents(
        chunk_tokens=chunk_tokens,
        chunk_of_document=np.concatenate(chunk_of_document or empty),
        start_in_chunk=np.concatenate(start_in_chunk or empty),
        lengths=np.concatenate(lengths or empty),
    )


def _pack_stream(documents: _Documents, seq_len: int, rng: np.random.Generator) -> _PackedStream:
    """Shuffle documents, concatenate them and cut the stream into padded rows with per-piece metadata.

    Work per token is a few sequential passes: a copy of the tokens, two in-place cumulative sums that turn
    per-piece steps into position and document ids, and a shifted copy for labels. Everything else is per piece.
    """
    num_documents = len(documents.lengths)
    num_tokens = int(documents.lengths.sum())
    num_rows = -(-num_tokens // seq_len)
    num_cells = num_rows * seq_len
    order = rng.permutation(num_documents)
    order = order[documents.lengths[order] > 0]  # [num_nonempty_documents] shuffled
    lengths = documents.lengths[order]
    if num_tokens == 0:
        empty = np.zeros((0, seq_len), np.int32)
        arrays = {"input_ids": empty, "labels": empty, "position_ids": empty, "document_ids": empty}
        return _PackedStream(arrays=arrays, num_real_tokens=0, num_documents=num_documents, num_documents_split=0)

    input_ids = np.empty(num_cells, np.int32)  # [num_cells] the shuffled stream, then padding
    spans = zip(documents.chunk_of_document[order].tolist(), documents.start_in_chunk[order].tolist(), lengths.tolist())
    np.concatenate(
        [documents.chunk_tokens[c][s : s + n] for c, s, n in spans], out=input_ids[:num_tokens], casting="same_kind"
    )
    input_ids[num_tokens:] = PAD_TOKEN_ID

    stream_starts = np.zeros(len(lengths), np.int64)  # [num_nonempty_documents] offset in the shuffled stream
    np.cumsum(lengths[:-1], out=stream_starts[1:])
    stream_last = stream_starts + lengths - 1  # [num_nonempty_documents] offset of each document's last token
    num_documents_split = int((stream_starts // seq_len != stream_last // seq_len).sum())

    # A piece starts at every document start and every row start.
    row_starts = np.arange(num_rows, dtype=np.int64) * seq_len  # [num_rows]
    piece_starts = np.union1d(stream_starts, row_starts)  # [num_pieces] sorted
    piece_lengths = np.diff(piece_starts, append=num_tokens)  # [num_pieces]
    first_piece_of_row = np.searchsorted(piece_starts, row_starts)  # [num_rows]
    pieces_per_row = np.diff(first_piece_of_row, append=len(piece_starts))  # [num_rows]
    piece_document_ids = np.arange(len(piece_starts)) - np.repeat(first_piece_of_row, pieces_per_row)  # [num_pieces]

    position_ids = np.ones(num_cells, np.int32)  # [num_cells] steps: +1, and back to 0 at each piece start
    position_ids[piece_starts[1:]] = 1 - piece_lengths[:-1]
    position_ids[0] = 0
    np.cumsum(position_ids, out=position_ids)
    position_ids[num_tokens:] = 0
    document_ids = np.zeros(num_cells, np.int32)  # [num_cells] steps: +1 at a piece start, back to 0 at a row start
    document_ids[piece_starts[1:]] = np.diff(piece_document_ids)
    np.cumsum(document_ids, out=document_ids)
    document_ids[num_tokens:] = PAD_DOCUMENT_ID
    labels = np.empty(num_cells, np.int32)  # [num_cells] the next token, except at a piece's last token
    labels[: num_tokens - 1] = input_ids[1:num_tokens]
    labels[piece_starts + piece_lengths - 1] = IGNORE_INDEX
    labels[num_tokens - 1 :] = IGNORE_INDEX

    arrays = {
        name: array.reshape(num_rows, seq_len)
        for name, array in (  # [num_rows, seq_len] each
            ("input_ids", input_ids),
            ("labels", labels),
            ("position_ids", position_ids),
            ("document_ids", document_ids),
        )
    }
    return _PackedStream(
        arrays=arrays, num_real_tokens=num_tokens, num_documents=num_documents, num_documents_split=num_documents_split
    )


def _mix_rows(parts: list[_PackedStream], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Rows of all parts; when short rows are mixed in, put them all in a seeded random order."""
    if len(parts) == 1 or len(parts[1].arrays["input_ids"]) == 0:
        return parts[0].arrays
    combined = {name: np.concatenate([part.arrays[name] for part in parts]) for name in parts[0].arrays}
    order = rng.permutation(len(combined["input_ids"]))
    return {name: array[order] for name, array in combined.items()}

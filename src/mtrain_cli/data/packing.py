"""Tokenise documents and pack them into fixed-length training rows that keep document boundaries.

Two ways to fill rows of exactly `seq_len` tokens (`data.packing`):
  concat    the documents, in a seeded shuffled order, are one token stream cut into rows; a document cut by a
            row boundary becomes two pieces. No padding but the last row's.
  best_fit  no document of up to `seq_len` tokens is ever cut: a longer one is cut into full rows of its own
            plus a remainder, and the remainders and short documents go into rows by best-fit decreasing (each,
            longest first, into the fullest row it fits); the rest of a row is padding, the rows in a seeded
            order. What a task whose question and answer sit far apart in one document needs (a retrieval
            document cut in two teaches an answer without its needle), at the cost of some padding.
Each row is an independent training sequence: every piece restarts its positions at 0 and gets its own document
id in its row, so attention and labels never cross a piece boundary. All per-token work is vectorised numpy.

A tokenised dataset may carry a `loss_mask` column (conversations, data/chat.py): a token is a label only where its
mask is 1, so the loss falls on the assistant's tokens alone. Datasets with and without one pack together.
"""

from __future__ import annotations

import bisect
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
    num_documents_split: int  # documents cut into 2+ pieces (best_fit: only those longer than seq_len)
    num_short_rows: int  # rows made of short-context documents
    num_loss_tokens: int  # labels that are not IGNORE_INDEX: the tokens the loss is taken on
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
    token_ds: datasets.Dataset | list[datasets.Dataset],
    seq_len: int,
    seed: int,
    *,
    short_ds: datasets.Dataset | list[datasets.Dataset] | None = None,
    short_fraction: float = 0.0,
    packing: str = "concat",
) -> PackedDataset:
    """Pack tokenised documents (`input_ids` column, and `loss_mask` where only some tokens are targets; a dataset
    or a list of them, in that order) into rows of exactly `seq_len` tokens; deterministic in `seed`.
    `packing`: concat or best_fit (the module's docstring).

    With `short_ds` and 0 < `short_fraction` < 1, about that fraction of all rows is built from `short_ds`
    (packed the same way); short tokens beyond those rows are counted in `num_tokens_dropped`, and the rows
    are put in a seeded order so any tail split (validation) sees both kinds. A partly filled row (concat: the
    last one) is padded, never dropped.
    """
    assert packing in ("concat", "best_fit"), packing
    start = time.perf_counter()
    if int(seq_len) != seq_len or seq_len < 2:
        raise UserError(f"data.seq_len {seq_len!r} must be an integer >= 2; set a sequence length such as 2048")
    if not 0.0 <= short_fraction < 1.0:
        raise UserError(f"data.short_fraction {short_fraction} must be in [0, 1); e.g. 0.1 for 10% short rows")
    if short_fraction > 0 and short_ds is None:
        raise UserError(f"data.short_fraction {short_fraction} needs data.short_sources (local short documents)")
    long = _pack_stream(_read_documents(token_ds), seq_len, np.random.default_rng([seed, 0]), packing)
    if long.num_real_tokens == 0:
        raise UserError("data.sources hold no tokens (every document is empty); pass documents with text")
    parts, num_dropped, num_short_rows = [long], 0, 0
    if short_ds is not None:
        short = _pack_stream(_read_documents(short_ds), seq_len, np.random.default_rng([seed, 1]), packing)
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
    num_pad = sum(int((part.arrays["document_ids"] == PAD_DOCUMENT_ID).sum()) for part in parts)
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
        num_loss_tokens=int((arrays["labels"] != IGNORE_INDEX).sum()),
        mean_documents_per_row=num_pieces / num_rows,
        tokens_per_second=num_input_tokens / max(time.perf_counter() - start, 1e-9),
    )
    return PackedDataset(**arrays, stats=stats)


@dataclass
class _Documents:
    """Tokenised documents as read from arrow, zero-copy: token ids per arrow chunk, and where each document is."""

    chunk_tokens: list[np.ndarray]  # [num_chunk_tokens] per chunk
    chunk_masks: list[np.ndarray | None]  # [num_chunk_tokens] 1 where a token is a target; None: every token is
    chunk_of_document: np.ndarray  # [num_documents]
    start_in_chunk: np.ndarray  # [num_documents]
    lengths: np.ndarray  # [num_documents]


def _read_documents(token_ds: datasets.Dataset | list[datasets.Dataset]) -> _Documents:
    """The `input_ids` (and `loss_mask`) columns, chunk by chunk (no concatenation: list offsets are int32 per
    chunk)."""
    chunk_tokens, chunk_masks, chunk_of_document, start_in_chunk, lengths = [], [], [], [], []
    for ds in token_ds if isinstance(token_ds, list) else [token_ds]:
        assert "input_ids" in ds.column_names, "pack_documents needs the output of tokenize_dataset"
        table = ds.with_format("arrow")[:]  # honours select/shuffle index mappings
        masks = table["loss_mask"].chunks if "loss_mask" in ds.column_names else None
        for index, chunk in enumerate(table["input_ids"].chunks):
            assert chunk.null_count == 0, "input_ids holds null documents"
            chunk_lengths = pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)
            chunk_starts = np.zeros(len(chunk_lengths), np.int64)
            np.cumsum(chunk_lengths[:-1], out=chunk_starts[1:])
            chunk_of_document.append(np.full(len(chunk_lengths), len(chunk_tokens), np.int64))
            chunk_tokens.append(chunk.flatten().to_numpy(zero_copy_only=False))  # zero-copy for int columns
            chunk_masks.append(masks[index].flatten().to_numpy(zero_copy_only=False) if masks is not None else None)
            start_in_chunk.append(chunk_starts)
            lengths.append(chunk_lengths)
    empty = [np.zeros(0, np.int64)]
    return _Documents(
        chunk_tokens=chunk_tokens,
        chunk_masks=chunk_masks,
        chunk_of_document=np.concatenate(chunk_of_document or empty),
        start_in_chunk=np.concatenate(start_in_chunk or empty),
        lengths=np.concatenate(lengths or empty),
    )


def _pack_stream(documents: _Documents, seq_len: int, rng: np.random.Generator, packing: str) -> _PackedStream:
    """Shuffle the documents and lay them out in rows (`packing`: the module's docstring)."""
    num_documents = len(documents.lengths)
    num_tokens = int(documents.lengths.sum())
    order = rng.permutation(num_documents)
    order = order[documents.lengths[order] > 0]  # [num_nonempty_documents] shuffled
    if num_tokens == 0:
        empty = np.zeros((0, seq_len), np.int32)
        arrays = {"input_ids": empty, "labels": empty, "position_ids": empty, "document_ids": empty}
        return _PackedStream(arrays=arrays, num_real_tokens=0, num_documents=num_documents, num_documents_split=0)
    if packing == "concat":
        return _cut_stream(documents, order, seq_len, num_documents)
    pieces, pad_per_row = _best_fit_pieces(documents, order, seq_len, rng)
    stream = _cut_stream(pieces, np.arange(len(pieces.lengths)), seq_len, num_documents)
    padding = np.arange(seq_len) >= seq_len - pad_per_row[:, None]  # [num_rows, seq_len] each row's padding piece
    stream.arrays["document_ids"][padding] = PAD_DOCUMENT_ID
    stream.arrays["labels"][padding] = IGNORE_INDEX
    stream.arrays["position_ids"][padding] = 0
    stream.num_real_tokens = num_tokens
    stream.num_documents_split = int((documents.lengths > seq_len).sum())
    return stream


def _best_fit_pieces(
    documents: _Documents, order: np.ndarray, seq_len: int, rng: np.random.Generator
) -> tuple[_Documents, np.ndarray]:
    """The documents `order` as pieces laid out row after row, best_fit: a document's full rows of `seq_len`, its
    remainder best-fit packed, the rows in a seeded order, each row's free cells one padding piece (read from an
    extra chunk of PAD_TOKEN_ID). -> (pieces in stream order, padding tokens per row [num_rows])."""
    lengths = documents.lengths[order]  # [num_nonempty_documents]
    num_full = lengths // seq_len  # full rows cut from each document
    rests = lengths - num_full * seq_len
    full_documents = np.repeat(order, num_full)  # [num_full_pieces]
    full_offsets = (np.arange(len(full_documents)) - np.repeat(np.cumsum(num_full) - num_full, num_full)) * seq_len
    has_rest = rests > 0
    piece_document = np.concatenate([full_documents, order[has_rest]])  # [num_pieces]
    piece_offset = np.concatenate([full_offsets, (num_full * seq_len)[has_rest]])
    piece_length = np.concatenate([np.full(len(full_documents), seq_len), rests[has_rest]])

    rest_rows, rest_fills = _best_fit(rests[has_rest].tolist(), seq_len)
    num_full_pieces = len(full_documents)
    rows = [[k] for k in range(num_full_pieces)] + [[num_full_pieces + k for k in row] for row in rest_rows]
    fills = [seq_len] * num_full_pieces + rest_fills
    sequence, pad_per_row = [], []  # piece indices in stream order, -1 for a padding piece
    for row in rng.permutation(len(rows)).tolist():
        sequence.extend(rows[row])
        pad_per_row.append(seq_len - fills[row])
        if fills[row] < seq_len:
            sequence.append(-1)
    sequence, pad_per_row = np.asarray(sequence), np.asarray(pad_per_row, np.int64)
    is_pad = sequence < 0
    document = piece_document[sequence]  # [num_stream_pieces] (garbage where is_pad, replaced below)
    chunk_tokens = documents.chunk_tokens + [np.full(seq_len, PAD_TOKEN_ID, documents.chunk_tokens[0].dtype)]
    stream_lengths = piece_length[sequence]
    stream_lengths[is_pad] = pad_per_row[pad_per_row > 0]
    pieces = _Documents(
        chunk_tokens=chunk_tokens,
        chunk_masks=[*documents.chunk_masks, None],
        chunk_of_document=np.where(is_pad, len(chunk_tokens) - 1, documents.chunk_of_document[document]),
        start_in_chunk=np.where(is_pad, 0, documents.start_in_chunk[document] + piece_offset[sequence]),
        lengths=stream_lengths,
    )
    return pieces, pad_per_row


def _best_fit(sizes: list[int], capacity: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing: each size, longest first (ties in the given order), into the row with the least room
    that holds it, else a new row. -> (item indices per row, tokens filled per row)."""
    rows: list[list[int]] = []
    fills: list[int] = []
    open_rows: list[tuple[int, int]] = []  # (room left, row), sorted
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = sizes[item]
        at = bisect.bisect_left(open_rows, (size, -1))
        if at == len(open_rows):
            rows.append([item])
            fills.append(size)
            row = len(rows) - 1
        else:
            _, row = open_rows.pop(at)
            rows[row].append(item)
            fills[row] += size
        if fills[row] < capacity:
            bisect.insort(open_rows, (capacity - fills[row], row))
    return rows, fills


def _cut_stream(documents: _Documents, order: np.ndarray, seq_len: int, num_documents: int) -> _PackedStream:
    """Concatenate the documents `order` and cut the stream into rows (the last one padded) with per-piece
    metadata.

    Work per token is a few sequential passes: a copy of the tokens, two in-place cumulative sums that turn
    per-piece steps into position and document ids, and a shifted copy for labels. Everything else is per piece.
    """
    lengths = documents.lengths[order]
    num_tokens = int(lengths.sum())
    num_rows = -(-num_tokens // seq_len)
    num_cells = num_rows * seq_len

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
    if any(documents.chunk_masks[c] is not None for c in np.unique(documents.chunk_of_document[order]).tolist()):
        is_target = np.empty(num_tokens, np.bool_)  # [num_tokens] the stream's loss masks (1: a target)
        spans = zip(
            documents.chunk_of_document[order].tolist(), documents.start_in_chunk[order].tolist(), lengths.tolist()
        )
        np.concatenate(
            [
                documents.chunk_masks[c][s : s + n] if documents.chunk_masks[c] is not None else np.ones(n, np.int8)
                for c, s, n in spans
            ],
            out=is_target,
            casting="unsafe",
        )
        labels[: num_tokens - 1][~is_target[1:]] = IGNORE_INDEX
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

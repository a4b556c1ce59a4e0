"""Data pipeline: local formats load, bad input is one clear line, packing keeps every token and every boundary,
the loader is deterministic, resumable and shards over ranks."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mtrain_cli.data import PackedDataset, SequenceLoader, load_text_dataset, pack_documents, tokenize_dataset
from mtrain_cli.errors import UserError

TEXTS = ["the quick brown fox jumps over the lazy dog", "pack me into rows", "a", "long context " * 40]


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few strings: no hub download."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>")


def token_dataset(lengths: list[int]) -> datasets.Dataset:
    """Documents whose tokens are their global stream index: each token is unique and names its document."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return datasets.Dataset.from_dict({"input_ids": [list(range(s, s + n)) for s, n in zip(starts, lengths)]})


def one_line_user_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# -- sources -----------------------------------------------------------------------------------------------------


def test_each_format_loads(tmp_path):
    rows = [{"text": t, "meta": i} for i, t in enumerate(TEXTS)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(TEXTS):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(text)
    (tmp_path / "parquet_dir" / "nested").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "parquet_dir" / "nested" / "0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "parquet_dir" / "nested" / "1.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:1]), "validation": datasets.Dataset.from_list(rows[1:])}
    ).save_to_disk(str(tmp_path / "dict"))

    for name in ("a.jsonl", "a.json", "a.parquet", "txt", "parquet_dir", "saved"):
        assert load_text_dataset(str(tmp_path / name))["text"] == TEXTS, name
    assert load_text_dataset(str(tmp_path / "txt" / "03.txt"))["text"] == [TEXTS[3]]  # one .txt = one document
    assert load_text_dataset(str(tmp_path / "dict"), split="validation")["text"] == TEXTS[1:]
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}))
    assert load_text_dataset(str(tmp_path / "b.jsonl"), text_field="body")["body"] == ["x"]


def test_bad_sources_raise_one_line_user_errors(tmp_path):
    with pytest.raises(UserError) as excinfo:
        load_text_dataset(str(tmp_path / "missing.jsonl"))
    assert "missing.jsonl" in one_line_user_error(excinfo) and "does not exist" in str(excinfo.value)

    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x", "id": 1}))
    with pytest.raises(UserError) as excinfo:
        load_text_dataset(str(tmp_path / "a.jsonl"))
    message = one_line_user_error(excinfo)
    assert "data.text_field 'text'" in message and "['body', 'id']" in message

    with pytest.raises(UserError, match="data.text_field 'id'.*not strings"):
        load_text_dataset(str(tmp_path / "a.jsonl"), text_field="id")

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": ')
    with pytest.raises(UserError) as excinfo:
        load_text_dataset(str(tmp_path / "bad.jsonl"))
    assert "could not be read as json" in one_line_user_error(excinfo)

    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(UserError, match="unsupported extension '.csv'"):
        load_text_dataset(str(tmp_path / "a.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .jsonl/.json/.parquet/.txt files"):
        load_text_dataset(str(tmp_path / "empty"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(UserError, match=r"split 'test' .* available splits: \['train'\]"):
        load_text_dataset(str(tmp_path / "d"), split="test")


# -- tokenize ----------------------------------------------------------------------------------------------------


def test_tokenize_appends_eos_drops_columns_and_is_cached(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t, "meta": 1}) for t in TEXTS))
    ds = load_text_dataset(str(tmp_path / "a.jsonl"))
    tokens = tokenize_dataset(ds, tokenizer)
    assert tokens.column_names == ["input_ids"]
    eos = tokenizer.eos_token_id
    assert tokens["input_ids"] == [tokenizer(t)["input_ids"] + [eos] for t in TEXTS]
    assert tokenize_dataset(ds, tokenizer, append_eos=False)["input_ids"][0] == tokenizer(TEXTS[0])["input_ids"]
    again = tokenize_dataset(ds, tokenizer)
    assert again._fingerprint == tokens._fingerprint and again.cache_files == tokens.cache_files  # cache hit


def test_tokenize_with_two_processes_matches_one(tokenizer):
    ds = datasets.Dataset.from_dict({"text": TEXTS * 3})
    assert tokenize_dataset(ds, tokenizer, num_proc=2)["input_ids"] == tokenize_dataset(ds, tokenizer)["input_ids"]


# -- pack --------------------------------------------------------------------------------------------------------


def real_pieces(packed: PackedDataset) -> list[np.ndarray]:
    """The token pieces of all rows, row by row, left to right, padding excluded."""
    pieces = []
    for ids, docs in zip(packed.input_ids, packed.document_ids):
        pieces += [ids[docs == d] for d in range(docs.max() + 1)]
    return pieces


def check_row_invariants(packed: PackedDataset, packing: str = "concat") -> None:
    seq_len = packed.stats.seq_len
    for array in (packed.input_ids, packed.labels, packed.position_ids, packed.document_ids):
        assert array.shape == (packed.stats.num_rows, seq_len)
    is_pad = packed.document_ids == -1
    if packing == "concat":
        assert not is_pad[:-1].any()  # only the last row is padded
    assert np.all(np.diff(is_pad.astype(int), axis=1) >= 0)  # padding only ends a row
    assert not is_pad[:, 0].any() and (packed.input_ids[is_pad] == 0).all()
    assert (packed.labels[is_pad] == -100).all() and (packed.position_ids[is_pad] == 0).all()
    real = np.maximum.accumulate(np.where(is_pad, 0, packed.document_ids), axis=1)  # padding: its row's last id
    steps = np.diff(real, axis=1)
    assert (packed.document_ids[:, 0] == 0).all() and np.isin(steps, (0, 1)).all()  # 0..k-1, increasing
    starts = np.concatenate([np.ones((len(real), 1), bool), steps == 1], axis=1) | is_pad
    expected_positions = np.zeros_like(packed.position_ids)
    for r in range(len(real)):
        start_columns = np.maximum.accumulate(np.where(starts[r], np.arange(seq_len), 0))
        expected_positions[r] = np.arange(seq_len) - start_columns
    assert (packed.position_ids == expected_positions).all()
    next_same_piece = np.concatenate([~starts[:, 1:], np.zeros((len(real), 1), bool)], axis=1)
    expected_labels = np.where(next_same_piece, np.roll(packed.input_ids, -1, axis=1), -100)
    assert (packed.labels == expected_labels).all()  # labels never cross a boundary


@pytest.mark.parametrize("seq_len", [8, 64])
def test_pack_keeps_every_token_once_in_order(seq_len):
    lengths = [5, 0, 130, 1, 17, 64, 3, 9, 200, 2]
    packed = pack_documents(token_dataset(lengths), seq_len, seed=3)
    check_row_invariants(packed)
    flat = np.concatenate(real_pieces(packed))  # [num_real_tokens]
    assert np.array_equal(np.sort(flat), np.arange(sum(lengths)))  # every token exactly once
    starts = np.concatenate([[0], np.cumsum(lengths)])
    docs = [np.arange(s, s + n) for s, n in zip(starts, lengths) if n]
    shuffled = sorted(docs, key=lambda d: np.flatnonzero(flat == d[0])[0])
    assert np.array_equal(flat, np.concatenate(shuffled))  # whole documents, order within each preserved
    for piece in real_pieces(packed):  # a piece never spans two documents
        assert np.array_equal(piece, np.arange(piece[0], piece[0] + len(piece)))
        assert len(piece) <= seq_len

    stats = packed.stats
    num_pad = int((packed.document_ids == -1).sum())
    assert stats.num_input_tokens == sum(lengths) == flat.size + stats.num_tokens_dropped
    assert stats.num_tokens_dropped == 0 and stats.num_pad_tokens == num_pad
    assert stats.num_rows * seq_len == flat.size + num_pad and stats.num_documents == len(lengths)
    doc_of_token = np.searchsorted(starts, flat, side="right") - 1
    row_of_token = np.arange(flat.size) // seq_len
    split = {d for d in set(doc_of_token) if len(set(row_of_token[doc_of_token == d])) > 1}
    assert stats.num_documents_split == len(split) and {2, 8} <= split  # 130 and 200 tokens > seq_len
    assert stats.mean_documents_per_row == pytest.approx(len(real_pieces(packed)) / stats.num_rows)
    assert stats.tokens_per_second > 0


@pytest.mark.parametrize("seq_len", [8, 64])
def test_best_fit_never_cuts_a_document_that_fits_a_row(seq_len):
    lengths = [5, 0, 130, 1, 17, 64, 3, 9, 200, 2, 7, 8, 6, 40, 33, 63]
    packed = pack_documents(token_dataset(lengths), seq_len, seed=3, packing="best_fit")
    check_row_invariants(packed, "best_fit")
    pieces = real_pieces(packed)
    flat = np.concatenate(pieces)
    assert np.array_equal(np.sort(flat), np.arange(sum(lengths)))  # every token exactly once
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for piece in pieces:
        doc = np.searchsorted(starts, piece[0], side="right") - 1
        assert np.array_equal(piece, np.arange(piece[0], piece[0] + len(piece)))  # contiguous, one document
        if lengths[doc] <= seq_len:
            assert len(piece) == lengths[doc]  # whole
        else:  # full rows of it, then its remainder
            assert (piece[0] - starts[doc]) % seq_len == 0
            assert len(piece) == seq_len or piece[-1] == starts[doc + 1] - 1
    full_rows = (packed.document_ids == 0).all(axis=1)
    assert full_rows.sum() == sum(n // seq_len for n in lengths)
    stats = packed.stats
    assert stats.num_documents_split == sum(n > seq_len for n in lengths)
    assert stats.num_pad_tokens == int((packed.document_ids == -1).sum()) > 0
    assert stats.num_rows * seq_len == flat.size + stats.num_pad_tokens
    assert stats.num_input_tokens == sum(lengths) and stats.num_documents == len(lengths)


def test_best_fit_puts_each_document_in_the_fullest_row_that_holds_it():
    # Longest first: 7 | 6 | 5 | 5 joins 5 (room 5) | 4 joins 6 (room 4; 7's room is 3) | 3 joins 7 | 3 | 2 joins 3
    lengths = [6, 4, 5, 5, 3, 3, 2, 7]
    packed = pack_documents(token_dataset(lengths), 10, seed=0, packing="best_fit")
    rows = sorted(sorted(int((docs == d).sum()) for d in range(docs.max() + 1)) for docs in packed.document_ids)
    assert rows == [[2, 3], [3, 7], [4, 6], [5, 5]] and packed.stats.num_pad_tokens == 5


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_pack_is_deterministic_per_seed(packing):
    ds = token_dataset([7, 3, 12, 5, 9, 1, 4, 6] * 4)
    first, again, other = (pack_documents(ds, 16, seed, packing=packing) for seed in (0, 0, 1))
    for name in ("input_ids", "labels", "position_ids", "document_ids"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.input_ids, other.input_ids)


def test_pack_reads_concatenated_and_reordered_datasets():
    lengths = [6, 11, 3, 20, 9]
    ds = token_dataset(lengths)
    two_chunks = datasets.concatenate_datasets([ds.select(range(2)), ds.select(range(2, 5))])
    reordered = ds.shuffle(seed=0)  # an index mapping over the arrow table
    for variant in (two_chunks, reordered):
        flat = np.concatenate(real_pieces(pack_documents(variant, 8, seed=0)))
        assert np.array_equal(np.sort(flat), np.arange(sum(lengths)))
    assert two_chunks.with_format("arrow")[:]["input_ids"].num_chunks == 2


def test_pack_tokenized_text_round_trips(tmp_path, tokenizer):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    packed = pack_documents(tokenize_dataset(load_text_dataset(str(tmp_path / "a.jsonl")), tokenizer), 32, seed=0)
    check_row_invariants(packed)
    text = tokenizer.decode(np.concatenate(real_pieces(packed)).tolist())
    assert sorted(text.split("<eos>")[:-1]) == sorted(TEXTS)


def test_short_mix_fraction_and_accounting():
    long_lengths, short_lengths = [300] * 20, [5] * 400  # 375 long rows of 16 ... short tokens are >= 10000
    long = token_dataset(long_lengths)
    short = datasets.Dataset.from_dict({"input_ids": [[10_000 + i] * n for i, n in enumerate(short_lengths)]})
    packed = pack_documents(long, 16, seed=0, short_ds=short, short_fraction=0.2)
    check_row_invariants(packed)
    is_short_row = (packed.input_ids >= 10_000).all(axis=1)
    assert packed.stats.num_short_rows == is_short_row.sum() == round(0.2 * 375 / 0.8)
    assert abs(is_short_row.mean() - 0.2) < 0.01
    assert not np.array_equal(np.flatnonzero(is_short_row), np.arange(375, len(packed)))  # rows are mixed
    num_real = int((packed.document_ids >= 0).sum())
    stats = packed.stats
    assert stats.num_input_tokens == sum(long_lengths) + sum(short_lengths) == num_real + stats.num_tokens_dropped
    assert stats.num_tokens_dropped == sum(short_lengths) - 16 * stats.num_short_rows

    with pytest.raises(UserError) as excinfo:
        pack_documents(long, 16, seed=0, short_ds=short, short_fraction=0.9)
    assert "data.short_fraction 0.9" in one_line_user_error(excinfo)
    for bad in (1.0, -0.1):
        with pytest.raises(UserError, match=f"data.short_fraction {bad} must be in"):
            pack_documents(long, 16, seed=0, short_ds=short, short_fraction=bad)


def test_pack_rejects_empty_data_and_bad_seq_len():
    with pytest.raises(UserError, match="no tokens"):
        pack_documents(token_dataset([0, 0]), 16, seed=0)
    with pytest.raises(UserError, match="data.seq_len 1"):
        pack_documents(token_dataset([4]), 1, seed=0)


def test_packed_dataset_items_and_split():
    packed = pack_documents(token_dataset([10] * 10), 8, seed=0)
    item = packed[2]
    assert set(item) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(t.dtype == torch.long and t.shape == (8,) for t in item.values())
    head, tail = packed.split(len(packed) - 3)
    assert len(head) == len(packed) - 3 and len(tail) == 3
    assert torch.equal(tail[0]["input_ids"], packed[len(packed) - 3]["input_ids"])


# -- loader ------------------------------------------------------------------------------------------------------


@pytest.fixture
def packed() -> PackedDataset:
    return pack_documents(token_dataset([13] * 40), 8, seed=0)  # 65 rows


def test_loader_batches_and_epochs(packed):
    loader = SequenceLoader(packed, batch_size=4, seed=0)
    batch = next(loader)
    assert all(t.dtype == torch.long and t.shape == (4, 8) for t in batch.values())
    epoch_rows = [next(loader)["input_ids"] for _ in range(loader.num_batches_per_epoch - 1)]
    firsts = torch.cat([batch["input_ids"], *epoch_rows])[:, 0].tolist()
    assert len(set(firsts)) == len(firsts) == 64  # one epoch: 16 distinct rows of 4 (last row skipped)
    assert loader.state_dict() == {"epoch": 0, "index": 16}
    next_epoch_first = next(loader)["input_ids"]
    assert loader.state_dict() == {"epoch": 1, "index": 1}
    assert not torch.equal(next_epoch_first, batch["input_ids"])  # each epoch has its own permutation
    in_order = SequenceLoader(packed, batch_size=5, seed=0, shuffle=False)
    assert torch.equal(next(in_order)["input_ids"], packed.rows(np.arange(5))["input_ids"])


def test_loader_resume_matches_uninterrupted(packed):
    uninterrupted = SequenceLoader(packed, batch_size=3, seed=7)
    expected = [next(uninterrupted) for _ in range(50)]  # crosses two epoch boundaries (21 batches per epoch)
    for stop in (0, 5, 21, 30):
        first = SequenceLoader(packed, batch_size=3, seed=7)
        for _ in range(stop):
            next(first)
        resumed = SequenceLoader(packed, batch_size=3, seed=7)
        resumed.load_state_dict(first.state_dict())
        for want in expected[stop:]:
            got = next(resumed)
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_loader_ranks_take_disjoint_batches(packed):
    world_size = 3
    loaders = [SequenceLoader(packed, 4, seed=1, rank=r, world_size=world_size) for r in range(world_size)]
    assert loaders[0].num_batches_per_epoch == 65 // 12
    batches = [[next(loader)["input_ids"] for _ in range(loader.num_batches_per_epoch)] for loader in loaders]
    rows = [tuple(row.tolist()) for rank_batches in batches for batch in rank_batches for row in batch]
    assert len(set(rows)) == len(rows) == 5 * 12  # no row seen by two ranks in an epoch
    single = SequenceLoader(packed, 4, seed=1)
    global_batches = [next(single)["input_ids"] for _ in range(15)]
    assert torch.equal(global_batches[4], batches[1][1])  # rank 1 takes global batches 1, 4, 7, ...


def test_loader_rejects_too_few_rows_and_foreign_state(packed):
    with pytest.raises(UserError) as excinfo:
        SequenceLoader(packed, batch_size=100, seed=0)
    assert "train.batch_size 100" in one_line_user_error(excinfo)
    loader = SequenceLoader(packed, batch_size=4, seed=0)
    with pytest.raises(UserError, match="does not fit this data"):
        loader.load_state_dict({"epoch": 0, "index": 17})

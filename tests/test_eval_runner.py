"""The `mtrain eval` model side: chunked prefill + greedy decoding, PG-19 perplexity against an independent
computation, and loading an HF directory, an mtrain run directory or one of its checkpoints."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fixtures.eval_corpus import (
    one_thread,  # noqa: F401  (autouse: this module runs on one thread)
    shipped_tokenizer,
    write_pg19,
)
from tiny_setup import SMALL_MODEL, save_weights
from transformers import AutoModelForCausalLM, Qwen2Config

from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import load_config, to_yaml
from mtrain_cli.errors import UserError
from mtrain_cli.eval.loading import load_model
from mtrain_cli.eval.options import check_attention
from mtrain_cli.eval.pg19 import CSV_NAME, CURVE_NAME, SECOND_HALF, load_books, prepare_pg19, score_pg19
from mtrain_cli.eval.runner import Runner
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.train.export import export_hf


@pytest.fixture(scope="module")
def tokenizer():
    return shipped_tokenizer()


def tiny_qwen2(tokenizer, **config_items) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        **config_items,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_qwen2(tokenizer)


def _independent_nll(model, ids: list[int], first: int = 0) -> tuple[float, int]:
    """Summed next-token NLL of positions first+1.. from one full forward pass with full logits, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, first:-1].double()
    return float(F.cross_entropy(logits, torch.tensor(ids[first + 1 :]), reduction="sum")), len(ids) - 1 - first


@pytest.mark.parametrize("prefill_chunk", [1000, 32])
def test_generate_matches_transformers_greedy(model, tokenizer, prefill_chunk):
    torch.manual_seed(1)
    prompt = torch.randint(0, 500, (1, 150))
    model.generation_config.eos_token_id = None
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 150:].tolist()
    runner = Runner(model, tokenizer, prefill_chunk=prefill_chunk)
    runner.eos_ids = set()  # the shipped tokenizer's <|endoftext|> would stop early, as it should
    assert runner.generate([prompt[0].tolist()], [12]) == [tokenizer.decode(expected, skip_special_tokens=True).strip()]
    # An end-of-sequence token ends the answer before it, however much budget is left.
    runner.eos_ids = {expected[3]}
    cut = expected.index(expected[3])
    assert runner.generate([prompt[0].tolist()], [12]) == [
        tokenizer.decode(expected[:cut], skip_special_tokens=True).strip()
    ]


@pytest.mark.parametrize("prefill_chunk", [1000, 32])
def test_batched_decoding_gives_each_prompt_its_batch_one_answer(tokenizer, prefill_chunk):
    """Prompts of other lengths (left padding), budgets and end tokens decode together: each answer is the one
    it gets alone. fp64 and wide weights: the padded keys, if attended, change the greedy tokens."""
    model = tiny_qwen2(tokenizer, initializer_range=0.2).double()
    runner = Runner(model, tokenizer, prefill_chunk=prefill_chunk)
    runner.eos_ids = set()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in (150, 97, 150, 40, 61)]
    budgets = [12, 5, 1, 9, 12]
    alone = [runner.generate([ids], [budget])[0] for ids, budget in zip(prompts, budgets)]
    assert len(set(alone)) == len(alone) and all(alone)
    assert runner.generate(prompts, budgets) == alone
    # A token that ends one prompt's answer early takes that row out of the batch; the others go on.
    model.generation_config.eos_token_id = None
    first = model.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    runner.eos_ids = {int(first[0, len(prompts[0]) + 3])}
    ended = [runner.generate([ids], [budget])[0] for ids, budget in zip(prompts, budgets)]
    assert ended[0] != alone[0]
    assert runner.generate(prompts, budgets) == ended


@pytest.mark.parametrize("prefill_chunk, head_chunk", [(10_000, 10_000), (64, 50), (37, 16)])
def test_token_nll_equals_full_logits(model, tokenizer, prefill_chunk, head_chunk):
    torch.manual_seed(2)
    ids = torch.randint(0, 500, (300,)).tolist()
    nll_S1 = Runner(model, tokenizer, prefill_chunk=prefill_chunk, head_chunk=head_chunk).token_nll(ids)
    assert nll_S1.shape == (299,) and nll_S1.dtype == torch.float64 and bool((nll_S1 > 0).all())
    for first in (0, 149, 298):  # every token, the second half, the last one: each position's own NLL
        expected_nll, expected_tokens = _independent_nll(model, ids, first)
        assert nll_S1[first:].numel() == expected_tokens
        assert float(nll_S1[first:].sum()) == pytest.approx(expected_nll, rel=1e-5)


def test_pg19_perplexity_pools_nll_over_tokens(model, tokenizer, tmp_path):
    books, source = load_books(write_pg19(tmp_path / "pg19"), limit=10)
    assert [book.name for book in books] == ["a_book", "jsonl book", "parquet book"] and "first 3 books" in source
    lengths = [128, 512, 100_000]
    sequences, too_short = prepare_pg19(tokenizer, books, lengths)
    assert too_short == {128: 0, 512: 1, 100_000: 3}  # the parquet book is ~360 tokens
    assert all(len(ids) == length for length, _, ids in sequences)
    runner = Runner(model, tokenizer, prefill_chunk=100, head_chunk=64)
    results = [(length, book, runner.token_nll(ids)) for length, book, ids in sequences]
    suite = score_pg19(results, lengths, too_short, source, tmp_path)

    for length in (128, 512):
        independent = [_independent_nll(model, ids) for l, _, ids in sequences if l == length]
        pooled = math.exp(sum(n for n, _ in independent) / sum(t for _, t in independent))
        per_book_mean = sum(math.exp(n / t) for n, t in independent) / len(independent)
        assert suite.rows["perplexity"][length] == pytest.approx(pooled, rel=1e-5)
        assert len(independent) == 1 or suite.rows["perplexity"][length] != pytest.approx(per_book_mean, rel=1e-6)
        # the second half: positions length/2 .. length-1, pooled the same way
        halves = [_independent_nll(model, ids, length // 2 - 1) for l, _, ids in sequences if l == length]
        assert all(t == length // 2 for _, t in halves)
        second = math.exp(sum(n for n, _ in halves) / sum(t for _, t in halves))
        assert suite.rows[SECOND_HALF][length] == pytest.approx(second, rel=1e-5)
        assert second != pytest.approx(pooled, rel=1e-3)
    assert [(s.length, s.reason) for s in suite.skipped] == [(100_000, "all 3 books are shorter than 100000 tokens")]
    with open(tmp_path / CSV_NAME) as f:
        rows = list(csv.DictReader(f))
    assert [int(row["length"]) for row in rows] == [128, 512]
    assert [int(row["books"]) for row in rows] == [3, 2] and [int(row["tokens"]) for row in rows] == [381, 1022]
    assert [float(row["second_half_perplexity"]) for row in rows] == pytest.approx(
        [suite.rows[SECOND_HALF][128], suite.rows[SECOND_HALF][512]], rel=1e-3
    )
    assert (tmp_path / CURVE_NAME).stat().st_size > 1000 and suite.files == [CSV_NAME, CURVE_NAME]


def test_pg19_bad_input_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--pg19-dir .* does not exist"):
        load_books(tmp_path / "nowhere", limit=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no PG-19 books"):
        load_books(tmp_path / "empty", limit=1)
    (tmp_path / "bad.jsonl").write_text('{"title": "no text field"}\n')
    with pytest.raises(UserError, match="line 1 has no 'text' field"):
        load_books(tmp_path / "bad.jsonl", limit=1)


def test_run_directory_and_checkpoint_load_the_same_model(tmp_path):
    """A fake mtrain run (config.yaml, one checkpoint, export/) built with the trainer's own functions:
    the export (run directory) and the checkpoint (rebuilt from config.yaml) give the model's logits."""
    config = load_config("tiny", SMALL_MODEL)
    tokenizer = load_tokenizer(config)
    torch.manual_seed(5)
    trained = build_model(config, tokenizer, torch.device("cpu")).eval()
    run_dir = tmp_path / "tiny-run"
    checkpoint = run_dir / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    save_weights(trained, checkpoint)
    export_hf(trained, tokenizer, run_dir / "export")

    ids = torch.randint(0, 500, (1, 200))
    with torch.no_grad(), AttentionRouter():  # the model is built with mtrain's attention hook
        expected = trained(input_ids=ids).logits
    for path, source in ((run_dir, "run export"), (checkpoint, "checkpoint")):
        loaded = load_model(path, torch.device("cpu"))
        assert loaded.source == source
        assert loaded.model.config.rope_parameters["rope_type"] == "yarn"
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)

    with pytest.raises(UserError, match="neither a Hugging Face directory"):
        load_model(tmp_path, torch.device("cpu"))


def test_attention_modes():
    check_attention("dense")
    check_attention("sparse")
    with pytest.raises(UserError, match="--attention 'flash' is not a mode"):
        check_attention("flash")


def test_hf_directory_loads(tmp_path, model, tokenizer):
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    loaded = load_model(Path(tmp_path / "hf"), torch.device("cpu"))
    assert (loaded.source, loaded.name, loaded.dtype) == ("hf", "hf", torch.float32)
    ids = torch.randint(0, 500, (1, 50))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits)

"""The shipped demo corpus and tokenizer are exactly what data/make_corpus.py generates, and carry the planted
facts the demo's model is meant to learn to retrieve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

DATA = Path(__file__).resolve().parents[1] / "data"


def test_generator_reproduces_the_shipped_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(DATA / "make_corpus.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    shipped = sorted(
        p.relative_to(DATA)
        for p in DATA.rglob("*")  # generated files; not the generators' code
        if p.is_file() and p.suffix != ".py" and "__pycache__" not in p.parts and "tiny-base" not in p.parts
    )  # nor the demo's base model (recipes/tiny-base.yaml makes it)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated == shipped
    for relative in shipped:
        assert (tmp_path / relative).read_bytes() == (DATA / relative).read_bytes(), relative


def test_long_documents_plant_a_pass_key_and_ask_for_it():
    rows = [json.loads(line) for line in (DATA / "corpus" / "long.jsonl").read_text().splitlines()]
    assert len(rows) == 600
    for row in rows[:50]:
        text = row["text"]
        keys = re.findall(r"The pass key is (\d+)\. Remember it\.", text)
        assert len(keys) == 1
        question_at = text.rfind("pass key")
        assert keys[0] in text[question_at:], "the answer follows the question at the end"


def test_tokenizer_is_byte_level_with_an_eos_that_pads():
    tokenizer = AutoTokenizer.from_pretrained(str(DATA / "tokenizer"), local_files_only=True)
    assert len(tokenizer) == 512
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    text = "The pass key is 48213. Ünïcödé survives byte-level BPE."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_passkey_documents_are_evals_passkey_prompt_then_the_answer():
    """What the demo's models train on is what `mtrain eval --suite infinitebench --tasks passkey` asks, with the
    answer after it, and fits the context it is for: 256 tokens (pretraining), 2,048 (extension)."""
    from mtrain_cli.eval.haystack import NOISE_HAYSTACK
    from mtrain_cli.eval.infinitebench.tasks import render
    from mtrain_cli.eval.prompts import PromptFormat

    tokenizer = AutoTokenizer.from_pretrained(str(DATA / "tokenizer"), local_files_only=True)
    fmt = PromptFormat(tokenizer, chat_template=False)
    for name, num_docs, context in (("passkey_short", 3000, 256), ("passkey_long", 300, 2048)):
        rows = [json.loads(line)["text"] for line in (DATA / "corpus" / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == num_docs
        assert max(len(ids) for ids in tokenizer(rows)["input_ids"]) <= context
        for text in rows[:20]:
            (key,) = re.findall(r"The pass key is (\d+)\. Remember it\. \1 is the pass key\.", text)
            haystack = text.split("\n\n")[1]
            needle = f"The pass key is {key}. Remember it. {key} is the pass key."
            noise = haystack.replace(f"{needle} ", "").replace(f" {needle}", "").replace(needle, "")
            assert noise == " ".join(NOISE_HAYSTACK.sentences(noise.count(".")))
            assert text == fmt.text(*render("passkey", haystack, "What is the pass key?", [])) + f" {key}."

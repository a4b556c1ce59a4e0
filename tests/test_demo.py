"""The built-in demo (`mtrain demo`, what `make demo` runs): the shipped base is the model recipes/tiny-base.yaml
describes and recipes/tiny.yaml extends, no prompt the demo asks is a training document, and the whole pipeline
runs (at a tiny scale here) to its before/after table."""

from __future__ import annotations

import json
import re

from rich.console import Console

from mtrain_cli.config import load_config
from mtrain_cli.demo import LENGTHS, SAMPLES, SEED, run_demo
from mtrain_cli.eval.infinitebench.suite import TaskInput, prepare_infinitebench
from mtrain_cli.eval.loading import load_model
from mtrain_cli.eval.prompts import PromptFormat
from mtrain_cli.lengths import parse_lengths
from mtrain_cli.resources import shipped_path

SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def test_the_shipped_base_is_the_tiny_base_recipes_model_in_the_tiny_recipes_shape():
    hf_config = json.loads((shipped_path("data/tiny-base") / "config.json").read_text())
    pretrain, extension = load_config("tiny-base"), load_config("tiny")
    for field in SHAPE:
        assert hf_config[field] == getattr(pretrain.model, field) == getattr(extension.model, field), field
    assert hf_config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert pretrain.context.method == "none" and pretrain.data.seq_len == 256
    assert extension.context.method == "yarn" and extension.extended_context() == 2048 == extension.data.seq_len


def test_no_prompt_the_demo_asks_is_a_training_document():
    """Eval draws its samples from its own seed. A 5-digit pass key can recur by chance, in another document, but
    no eval prompt plus its answer is a document of the corpus."""
    fmt = PromptFormat(load_model(shipped_path("data/tiny-base")).tokenizer, chat_template=False)
    samples, skipped = prepare_infinitebench(
        fmt, {"passkey": TaskInput("generated", None)}, parse_lengths(LENGTHS), SAMPLES, SEED
    )
    assert not skipped and len(samples) == SAMPLES * len(parse_lengths(LENGTHS))
    asked = {fmt.tokenizer.decode(sample.input_ids) + f" {sample.references[0]}." for sample in samples}
    corpus = {
        json.loads(line)["text"]
        for path in sorted(shipped_path("data/corpus").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    }
    assert len(asked) == len(samples) and all(text.startswith("There is an important info") for text in asked)
    assert not asked & corpus


def test_the_demo_extends_evaluates_three_models_and_prints_the_table(tmp_path):
    corpus = shipped_path("data/corpus/passkey_short.jsonl")
    small = (
        "train.num_steps=2",
        "train.warmup_steps=1",
        "train.eval_every=2",
        "checkpoint.every=2",
        "data.seq_len=512",
        f"data.sources=[{corpus}]",
        "data.short_sources=[]",
        "data.short_fraction=0",
        "data.num_val_rows=1",
        "logging.every=1",
    )
    console = Console(record=True, width=200)
    result = run_demo(console, tmp_path, overrides=small, lengths="256", samples=1)

    assert (result.extend_run / "export" / "config.json").is_file()
    runs = {
        name: json.loads((path / "results.json").read_text())
        for name, path in (("base", result.base), ("yarn", result.base_yarn), ("extended", result.extended))
    }
    assert runs["base"]["yarn"] is None and runs["base"]["model"]["max_position_embeddings"] == 256
    assert runs["yarn"]["yarn"]["factor"] == 8 and runs["yarn"]["model"]["max_position_embeddings"] == 2048
    assert runs["base"]["model"]["path"] == runs["yarn"]["model"]["path"] == str(shipped_path("data/tiny-base"))
    assert runs["extended"]["model"]["source"] == "run export" and runs["extended"]["yarn"] is None
    assert all(run["tasks"] == ["passkey"] and run["seed"] == SEED for run in runs.values())
    printed = console.export_text()
    table = printed[printed.index("passkey retrieval, % of 1 samples") :]
    for label in (
        "base, RoPE as pretrained (256 tokens)",
        "base + YaRN x8, no training",
        "extended: YaRN x8 + 2 steps at 512 tokens",
    ):
        (row,) = [line for line in table.splitlines() if label in line]
        assert re.search(r"│\s+\d+ │$", row), row  # its score at 256 tokens

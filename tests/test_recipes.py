"""The shipped recipes for the paper's two models (Qwen2.5-3B 32K -> 512K, Llama-3.1-8B 128K -> 512K) and a
Qwen3 (Qwen3-8B 32K -> 256K) run on the published configs of those models: each recipe's model section is the
model's config.json (so a dry-run without --model plans the real model), a dry-run with --model counts the
published parameters, plans memory that fits and writes the RoPE arithmetic that follows from the published
values (original lengths, theta, llama3 factors), and 3 CPU steps run on a scaled-down copy of each config
with the recipe's own RoPE and sparse attention."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_setup import run_cli, write_documents, write_tensorless_weights
from transformers import AutoConfig, AutoModelForCausalLM

from mtrain_cli.config import load_config
from mtrain_cli.dry_run import make_dry_run, memory_fit
from mtrain_cli.model import load_tokenizer
from mtrain_cli.train.run import run_extend

# config.json values as published on the models' pages (the keys mtrain reads)
PUBLISHED = {
    "Llama-3.1-8B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
    },
    "Qwen2.5-3B": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
}
# recipe -> (model, published parameter count, the RoPE the extension must write, extended context)
RECIPES = {
    "llama3.1-8b-512k": (
        "Llama-3.1-8B",
        8_030_261_248,
        # YaRN over the 8,192 pretraining tokens: 512K / 8K = 64, llama3's bands as β
        {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}
        | {"beta_fast": 4.0, "beta_slow": 1.0},
        524288,
    ),
    "qwen2.5-3b-512k": (
        "Qwen2.5-3B",
        3_085_938_688,
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
        | {"beta_fast": 32.0, "beta_slow": 1.0},
        524288,
    ),
    "qwen3-8b-256k": (
        "Qwen3-8B",
        8_190_735_360,
        # Qwen's YaRN counts from the 32,768 pretraining tokens, not the config's 40,960
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
        | {"beta_fast": 32.0, "beta_slow": 1.0},
        262144,
    ),
}


def published_dir(name: str, root, **shrink):
    """A directory with the model's published config.json (sizes replaced by `shrink`) and the shipped
    tokenizer; with `shrink`, random weights too (a scaled-down copy that keeps the RoPE and the family)."""
    fields = dict(PUBLISHED[name])
    model_type = fields.pop("model_type")
    theta, scaling = fields.pop("rope_theta"), fields.pop("rope_scaling", None)
    fields["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    hf_config = AutoConfig.for_model(model_type, **{**fields, **shrink})
    directory = root / name
    tokenizer = load_tokenizer(load_config("tiny"))
    if shrink:
        hf_config.vocab_size = len(tokenizer)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(directory)
    else:
        hf_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipes_model_section_is_the_published_config(recipe):
    name = RECIPES[recipe][0]
    published, m = PUBLISHED[name], load_config(recipe).model
    assert m.path is None and m.architecture == published["model_type"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(m, key) == published[key], key
    assert (m.num_key_value_heads, m.max_position_embeddings) == (
        published["num_key_value_heads"],
        published["max_position_embeddings"],
    )
    assert (m.rope_theta, m.rope_scaling, m.tie_word_embeddings) == (
        published["rope_theta"],
        published.get("rope_scaling"),
        published["tie_word_embeddings"],
    )
    assert (m.head_dim or m.hidden_size // m.num_attention_heads) == published.get("head_dim", 128)


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_on_the_published_config_plans_the_model_and_its_rope(recipe, tmp_path):
    name, num_params, rope, context = RECIPES[recipe]
    config = load_config(recipe, [f"model.path={published_dir(name, tmp_path)}"])
    plan = make_dry_run(config)
    assert plan.num_params == num_params and plan.params_note is None
    assert plan.rope.extended_context == context and plan.rope.method == "yarn"
    assert (plan.rope.factor, plan.rope.original_context, plan.rope.rope_theta) == (
        rope["factor"],
        rope["original_max_position_embeddings"],
        rope["rope_theta"],
    )
    assert plan.rope.num_kept + plan.rope.num_blended + plan.rope.num_interpolated == 64
    assert ("llama3" in plan.rope_start) == (name == "Llama-3.1-8B") and len(plan.rope_notes) == (
        name == "Llama-3.1-8B"
    )
    fit, warning = memory_fit(plan.memory)
    assert warning is None and 10 < plan.memory.total_gib < 0.9 * 139.8, fit


def test_dry_run_shows_where_the_rope_starts_its_bands_and_what_changes(tmp_path):
    """Llama-3.1-8B: the default (yarn) says loudly that llama3's scaling is replaced; context.method=llama3 keeps
    it with factor 32 and the same bands. Plain output, as piped to a file."""
    model_dir = published_dir("Llama-3.1-8B", tmp_path)
    write_tensorless_weights(model_dir)
    data = ["--data", str(write_documents(tmp_path / "docs.jsonl")), "--output-dir", str(tmp_path / "runs")]
    data += ["--set", "data.seq_len=4096", "--set", "data.num_val_rows=1", "--set", "data.num_proc=1"]
    base = ["extend", "--recipe", "llama3.1-8b-512k", "--model", str(model_dir), *data, "--dry-run"]
    yarn = run_cli(*base)
    assert yarn.returncode == 0, yarn.stderr
    out = " ".join(yarn.stdout.split())
    assert "RoPE from │ llama3: θ=500000, factor 8 over 8,192 → 131,072 tokens" in out
    assert "RoPE │ yarn: θ=500000, factor 64, 8,192 → 524,288 tokens" in out
    assert "YaRN bands │ 64 frequency pairs:" in out and "YaRN attention factor │ 1.4159" in out
    assert "warning: context.method yarn replaces the model's llama3 RoPE scaling (factor 8 over 8,192 tokens" in out
    llama3 = run_cli(*base, "--set", "context.method=llama3")
    out = " ".join(llama3.stdout.split())
    assert llama3.returncode == 0 and "RoPE │ llama3: θ=500000, factor 32, 8,192 → 524,288 tokens" in out
    assert "llama3 bands │ 64 frequency pairs:" in out and "warning" not in out


@pytest.mark.parametrize("recipe", RECIPES)
def test_three_cpu_steps_on_a_scaled_down_copy(recipe, tmp_path):
    """The recipe as shipped but for its size (and data, sequence length, one process): the copy keeps the
    published RoPE, context, head-dim rule and tied embeddings, so the run writes the full-size RoPE."""
    name, _, rope, context = RECIPES[recipe]
    shrink = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shrink |= dict(num_key_value_heads=2, **({"head_dim": 32} if "head_dim" in PUBLISHED[name] else {}))
    model_dir = published_dir(name, tmp_path, **shrink)
    overrides = [
        f"model.path={model_dir}",
        "data.sources=[data/corpus/long.jsonl]",
        "data.seq_len=512",
        "data.num_proc=1",
        "parallel.cp=1",
        "parallel.dp=1",
        "train.num_steps=3",
        "train.warmup_steps=1",
        "train.eval_every=3",
        "checkpoint.every=3",
        "attention.block_size=16",
        "attention.last_q=16",
        "attention.dense_below=64",
        f"run.output_dir={tmp_path / 'runs'}",
    ]
    result = run_extend(load_config(recipe, overrides), None, Console(file=io.StringIO()))
    summary = result.summary
    assert summary["steps"] == {"start": 0, "end": 3} and summary["attention_mode"] == "sparse"
    assert summary["attention_calls"].get("sparse-reference", 0) > 0
    exported = json.loads((result.run_dir / "export" / "config.json").read_text())
    assert rope.items() <= exported["rope_parameters"].items() and exported["max_position_embeddings"] == context
    assert exported["tie_word_embeddings"] == PUBLISHED[name]["tie_word_embeddings"]


def test_the_lora_recipe_plans_llama_31_8b_at_64k_within_one_80gb_gpu(tmp_path):
    """LoRA r16 on the 7 projections of 32 layers, plus the input embeddings and the 65 norms, train; the frozen
    base is planned in bf16, so the whole fits an 80 GB card (the floor: a peak of at most 70 GiB)."""
    config = load_config("llama3.1-8b-64k-lora", [f"model.path={published_dir('Llama-3.1-8B', tmp_path)}"])
    plan = make_dry_run(config)
    h, kv, mlp, r = 4096, 1024, 14336, 16
    adapters = 32 * r * ((h + h) * 2 + (h + kv) * 2 + (h + mlp) * 3)
    assert plan.num_params == 8_030_261_248
    assert plan.num_trainable_params == adapters + 128256 * h + 65 * h
    assert config.data.seq_len == 65536 and config.parallel.dp * config.parallel.cp == 1
    assert 40 < plan.memory.total_gib < 60, plan.memory
    # the plan against the peak this recipe measured on an H200 (bench/lora_8b: same shape, sequence and settings)
    measured = json.loads((Path(__file__).resolve().parents[1] / "bench/results/lora_8b_64k_h200.json").read_text())
    dense_peak = next(case["peak_mem_gib"] for case in measured["cases"] if case["case"] == "dense")
    assert plan.memory.total_gib == pytest.approx(dense_peak, rel=0.08), (plan.memory, dense_peak)
    chat = load_config("long-chat-sft")
    assert (chat.data.packing, chat.train.lora.rank, chat.extended_context()) == ("best_fit", 64, 65536)


def test_the_plan_keeps_fp32_layer_inputs_where_one_process_trains_fp32_weights(tmp_path):
    """Activation checkpointing keeps every layer's input. One process trains fp32 weights, so its residual stream
    is fp32 (4 B); FSDP2 computes in bf16, and LoRA in its bf16 base's dtype (2 B)."""
    model = published_dir("Llama-3.1-8B", tmp_path)
    sets = [f"model.path={model}", "train.activation_checkpointing=true"]
    lora = make_dry_run(load_config("llama3.1-8b-64k-lora", sets)).memory.activations_gib
    full = make_dry_run(load_config("llama3.1-8b-64k-lora", [*sets, "train.lora=null"])).memory.activations_gib
    sharded = make_dry_run(
        load_config("llama3.1-8b-64k-lora", [*sets, "train.lora=null", "parallel.dp=2"])
    ).memory.activations_gib
    layer_inputs_bf16 = 65536 * 4096 * 32 * 2 / 2**30  # 16 GiB
    assert full - lora == pytest.approx(layer_inputs_bf16) and sharded == pytest.approx(lora)

"""The model families users bring (mtrain_cli.model.tiny: Llama 3.1-style llama3 RoPE, Qwen3 with q/k norms and
its own head_dim, Mistral v0.2+), as local directories: `mtrain extend` trains each dense and sparse, resumes,
and exports a directory that transformers loads with mtrain's logits, the user's chat template, special tokens
and generation_config.json; `mtrain eval` runs dense and sparse on the export (sparse with the full pattern
gives the dense perplexity) and `--yarn` on a llama3 model; windowed attention and unknown families are one line.
The same families under context parallelism: test_distributed_train.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from fixtures.eval_corpus import one_thread, write_pg19  # noqa: F401  (one_thread: autouse, one CPU thread)
from rich.console import Console
from test_eval_cli import only_run_dir, run_main
from tiny_setup import small_run
from transformers import AutoModelForCausalLM

from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.model.tiny import save_tiny_model
from mtrain_cli.train.checkpoint import checkpoint_dirs, load_model_weights
from mtrain_cli.train.run import run_extend

CPU = torch.device("cpu")
SPARSE = ["attention.mode=sparse", "attention.block_size=16", "attention.last_q=16", "attention.dense_below=64"]
FAMILIES = ["llama3", "qwen3", "mistral", "phi3"]
RECIPES = {"phi3": ["context.method=theta", "context.rope_theta=4e4"]}  # Phi3Config holds no YaRN: a new base


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: save_tiny_model(family, root / family, seed=3) for family in FAMILIES}


def extend(model_dir: Path, out: Path, num_steps: int, *extra: str, resume: Path | None = None) -> tuple[Path, dict]:
    overrides = [*small_run(num_steps, out, "checkpoint.every=1", "context.factor=2"), f"model.path={model_dir}"]
    source = str(resume / "config.yaml") if resume is not None else "tiny"
    config = load_config(source, [f"train.num_steps={num_steps}"] if resume else [*overrides, *extra])
    result = run_extend(config, resume, quiet())
    return result.run_dir, result.summary


@pytest.mark.parametrize("mode", ["dense", "sparse"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_extends_resumes_and_exports_what_it_trained(family, mode, family_dirs, tmp_path):
    source = family_dirs[family]
    recipe = [*(SPARSE if mode == "sparse" else []), *RECIPES.get(family, [])]
    run_dir, summary = extend(source, tmp_path / "runs", 2, *recipe)
    calls = summary["attention_calls"]
    assert (calls.get("sparse-reference", 0) > 0) == (mode == "sparse") and (calls.get("dense", 0) > 0) == (
        mode == "dense"
    ), calls
    run_dir, summary = extend(source, tmp_path / "runs", 3, resume=run_dir)
    assert summary["steps"] == {"start": 2, "end": 3}

    config = load_config(str(run_dir / "config.yaml"))
    model = build_model(config, load_tokenizer(config), CPU).eval()
    ((step, last),) = checkpoint_dirs(run_dir / "checkpoints")[-1:]
    assert step == 3
    load_model_weights(last, model)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "export", local_files_only=True).eval()
    input_ids = torch.randint(0, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), AttentionRouter():
        ours = model(input_ids=input_ids, document_ids=torch.zeros_like(input_ids)).logits
        theirs = exported(input_ids=input_ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    hf = exported.config
    assert hf.model_type == ("llama" if family == "llama3" else family) and hf.max_position_embeddings == 2048
    if family == "llama3":  # YaRN over the pretraining context (64) with llama3's bands, said loudly
        assert hf.rope_parameters == {
            "rope_type": "yarn",
            "rope_theta": 5e5,
            "factor": 32.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 4.0,
            "beta_slow": 1.0,
        }
        assert any("replaces the model's llama3 RoPE scaling" in w for w in summary["warnings"])
    if family == "qwen3":  # its own head dim (2 × hidden/heads) and the per-head q/k norms
        assert hf.head_dim == 32 and exported.model.layers[0].self_attn.q_norm.weight.shape == (32,)
        assert exported.lm_head.weight is exported.model.embed_tokens.weight  # tied stays tied
    if family == "mistral":
        assert hf.sliding_window is None
    if family == "phi3":  # fused q/k/v and gate/up projections; plain RoPE with the new base
        assert hf.rope_parameters == {"rope_type": "default", "rope_theta": 4e4, "partial_rotary_factor": 1.0}
        assert exported.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    # the user's files come through: chat template, special tokens, generation settings
    assert (run_dir / "export" / "chat_template.jinja").read_text() == (source / "chat_template.jinja").read_text()
    tokens = [json.loads((d / "tokenizer_config.json").read_text()) for d in (source, run_dir / "export")]
    for key in ("eos_token", "pad_token", "bos_token"):
        assert tokens[1].get(key) == tokens[0].get(key), key
    generation = [json.loads((d / "generation_config.json").read_text()) for d in (source, run_dir / "export")]
    for key in ("eos_token_id", "bos_token_id", "do_sample", "temperature", "top_p"):
        assert generation[1][key] == generation[0][key], key


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_runs_a_family_dense_and_sparse(family, family_dirs, tmp_path, monkeypatch, capsys):
    """The family's model (llama3: with --yarn 2, i.e. YaRN over its pretraining context) through pg19 and NIAH:
    sparse attention with every key kept reproduces the dense perplexity and answers."""
    pg19 = write_pg19(tmp_path / "pg19")
    common = [str(family_dirs[family]), "--suite", "pg19,niah", "--lengths", "512"]
    common += ["--samples", "1", "--pg19-dir", str(pg19), *(["--yarn", "2"] if family == "llama3" else [])]
    full = ["p=1.0", "cap=1000000", "block_size=16", "dense_below=0", "last_q=16"]
    results = {}
    for attention in ("dense", "sparse"):
        extra = ["--attention", "sparse", *[a for item in full for a in ("--sparse-set", item)]]
        out = tmp_path / attention
        code, stdout, err = run_main(
            monkeypatch, capsys, "eval", *common, *(extra if attention == "sparse" else []), "--out", str(out)
        )
        assert code == 0, stdout + err
        run_dir = only_run_dir(out)
        results[attention] = json.loads((run_dir / "results.json").read_text())
        results[attention]["predictions"] = (run_dir / "predictions.jsonl").read_text()
    dense, sparse = results["dense"], results["sparse"]
    assert sparse["sparse"]["attention_calls"]["sparse-reference"] > 0
    perplexity = [r["suites"]["pg19"]["rows"]["perplexity"]["512"] for r in (dense, sparse)]
    assert perplexity[1] == pytest.approx(perplexity[0], rel=1e-5)
    answers = [[json.loads(line)["prediction"] for line in r["predictions"].splitlines()] for r in (dense, sparse)]
    assert len(answers[0]) == 11 and answers[1] == answers[0]  # one NIAH needle per depth


def test_a_sliding_window_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Mistral v0.1 attends through a 4,096-token window: extend refuses rows longer than it, and sparse eval
    refuses sequences longer than it (dense eval runs the window through transformers' own SDPA path)."""
    model_dir = save_tiny_model("mistral", tmp_path / "mistral-v0.1", sliding_window=128)
    config = load_config("tiny", [*small_run(1, tmp_path), f"model.path={model_dir}"])
    with pytest.raises(UserError, match=r"^--model: the model's layers attend through a sliding_window of 128 tokens"):
        build_model(config, load_tokenizer(config), CPU)
    short = load_config("tiny", [*small_run(1, tmp_path), f"model.path={model_dir}", "data.seq_len=128"])
    build_model(short, load_tokenizer(short), CPU)  # rows within the window: full causal attention is the same
    args = ["eval", str(model_dir), "--suite", "infinitebench", "--tasks", "passkey", "--lengths", "512"]
    code, _, err = run_main(monkeypatch, capsys, *args, "--samples", "1", "--attention", "sparse")
    assert code == 2 and "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "the model's attention uses a sliding_window of 128 tokens" in line


def test_fresh_models_of_each_architecture_have_their_shape():
    """Recipes describe fresh Qwen3 (own head_dim) and Mistral (no window) models, and Llama 3.1's llama3 RoPE."""
    from mtrain_cli.model import build_hf_config

    base = ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_key_value_heads=2"]
    qwen3 = build_hf_config(load_config("tiny", [*base, "model.architecture=qwen3", "model.head_dim=32"]), 512)
    assert type(qwen3).__name__ == "Qwen3Config" and qwen3.head_dim == 32
    assert build_hf_config(load_config("tiny", [*base, "model.architecture=qwen3"]), 512).head_dim == 16
    mistral = build_hf_config(load_config("tiny", [*base, "model.architecture=mistral"]), 512)
    assert type(mistral).__name__ == "MistralConfig" and mistral.sliding_window is None
    scaling = (
        "{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 16}"
    )
    llama = load_config("tiny", [*base, "model.architecture=llama", f"model.rope_scaling={scaling}"])
    notes: list[str] = []
    hf = build_hf_config(llama, 512, notes)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 8 * 256 / 16 and notes
    bad = load_config("tiny", [*base, "model.rope_scaling={rope_type: llama3, factor: 8}"])
    with pytest.raises(UserError, match=r"^model.rope_scaling \(llama3\) lacks low_freq_factor, high_freq_factor"):
        build_hf_config(bad, 512)


def test_a_phi3_model_trains_with_plain_rope_only(tmp_path, monkeypatch, capsys):
    """Phi3Config reads rope_type yarn as its longrope, and longrope picks its frequencies by sequence length (which
    differs between the ranks of a ring): YaRN, a fresh model's scaling and a longrope checkpoint are one line."""
    from transformers import Phi3Config

    from mtrain_cli.config import ContextConfig
    from mtrain_cli.model import apply_context_extension, build_hf_config

    model_dir = save_tiny_model("phi3", tmp_path / "phi3")
    config = load_config("tiny", [*small_run(1, tmp_path), f"model.path={model_dir}"])
    message = r"^context.method yarn: mtrain runs Phi-3/Phi-4 models with rope_type default only, not yarn; "
    with pytest.raises(UserError, match=message + "extend it with context.method=theta"):
        build_model(config, load_tokenizer(config), CPU)
    scaling = "model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 64}"
    fresh = load_config("tiny", ["model.architecture=phi3", scaling, "context.method=none", "data.seq_len=256"])
    with pytest.raises(UserError, match=r"^model.rope_scaling: mtrain runs Phi-3/Phi-4 .* not yarn; leave it null"):
        build_hf_config(fresh, 512)
    code, _, err = run_main(monkeypatch, capsys, "eval", str(model_dir), "--suite", "niah", "--yarn", "2")
    assert code == 2 and "Traceback" not in err and "--yarn 2: mtrain runs Phi-3/Phi-4 models" in err
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3_128k = Phi3Config(hidden_size=64, num_attention_heads=4, rope_parameters=longrope, pad_token_id=None)
    with pytest.raises(UserError, match=r"^context.method none: .* not longrope; use one with plain RoPE$"):
        apply_context_extension(phi3_128k, ContextConfig(method="none"))

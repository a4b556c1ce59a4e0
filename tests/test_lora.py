"""LoRA (`train.lora`, peft): under cp = 2 (gloo, FSDP2) the one-process losses and adapter gradients, dense and
sparse; a resumed run reproduces the uninterrupted losses from checkpoints that hold only what trains; the merged
export loads as a plain model with the adapted model's logits, and `mtrain eval` takes it, a LoRA checkpoint and
the adapter alone."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from safetensors import safe_open
from spawned_ranks import run_ranks
from tiny_setup import SMALL_MODEL, only_run_dir, run_cli, set_args, small_run, step_losses
from transformers import AutoModelForCausalLM

from mtrain_cli.attention import AttentionRouter
from mtrain_cli.config import load_config
from mtrain_cli.eval.loading import load_model
from mtrain_cli.model import build_model, load_tokenizer, save_tiny_model
from mtrain_cli.train.checkpoint import load_model_weights
from mtrain_cli.train.distributed import init_parallel
from mtrain_cli.train.loop import build_trainer
from mtrain_cli.train.lora import apply_lora

LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.train_embeddings_norms=true"]
BASE = [
    *SMALL_MODEL,
    "train.num_steps=4",
    "train.warmup_steps=1",
    "train.grad_clip=0",
    "train.lr=3e-3",
    "attention.block_size=32",
    *LORA,
]
FULL_SPARSE = [  # p = 1 keeps the whole probed pattern: sparse equals dense
    "attention.mode=sparse",
    "attention.p=1.0",
    "attention.cap=100000",
    "attention.dense_below=0",
    "attention.last_q=32",
    "attention.local_window=32",
]


def two_steps(overrides: list[str], out: Path) -> dict:
    """The losses of two steps and the gradients of the second (B is zero at first: A's gradients too)."""
    config = load_config("tiny", [*overrides, f"run.output_dir={out}"])
    trainer = build_trainer(config, out, Console(file=io.StringIO()), init_parallel(config))
    trainer.data.loader.shuffle = False
    grads: dict[str, torch.Tensor] = {}
    zero_grad = trainer.optimizer.zero_grad

    def capture(**kwargs):  # right after optimizer.step(): the step's gradients are still there
        grads.clear()
        for name, param in trainer.model.named_parameters():
            if param.grad is not None:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                grads[name] = grad.detach().clone()
        zero_grad(**kwargs)

    trainer.optimizer.zero_grad = capture
    losses = [trainer.train_step().loss for _ in range(2)]
    frozen = [name for name, param in trainer.model.named_parameters() if not param.requires_grad]
    return {"losses": losses, "grads": grads, "frozen": frozen}


CP_CASES = [[], FULL_SPARSE]


def _cp_rank(rank: int, world: int, port: int, out: str, base_dir: str) -> None:
    torch.set_num_threads(1)
    # a local model under 2 ranks is built on the meta device: its base weights are read by name from the files
    # (LoRA renames them), its adapters initialised again after; with B = 0 the first loss is the base model's
    cases = [*CP_CASES, [f"model.path={base_dir}"]]
    for index, extra in enumerate(cases):
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + index),
        )  # fmt: skip
        try:
            result = two_steps([*BASE, *extra, "parallel.cp=2"], Path(out) / str(index))
            if rank == 0:
                torch.save(result, Path(out) / f"{index}.pt")
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lora_cp")
    base = save_tiny_model("qwen2", out / "base", context=64, seed=3, dtype=torch.bfloat16)
    run_ranks(_cp_rank, 2, str(out), str(base), error_dir=out)
    return [torch.load(out / f"{index}.pt") for index in range(len(CP_CASES) + 1)]


@pytest.mark.parametrize("case", range(len(CP_CASES)), ids=["dense", "sparse"])
def test_lora_under_cp2_gives_the_one_process_losses_and_adapter_gradients(case, cp_results, tmp_path):
    reference = two_steps([*BASE, *CP_CASES[case]], tmp_path)
    got = cp_results[case]
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert got["grads"].keys() == reference["grads"].keys()
    names = set(reference["grads"])
    assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names  # train_embeddings_norms
    assert not any(".base_layer." in n for n in names)  # the base stays frozen
    assert any(".base_layer." in n for n in reference["frozen"])
    for name, grad in reference["grads"].items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_local_model_with_lora_under_cp2_reads_its_base_weights_by_name(cp_results, tmp_path):
    base = tmp_path / "base"
    save_tiny_model("qwen2", base, context=64, seed=3, dtype=torch.bfloat16)
    reference = two_steps([*BASE, f"model.path={base}"], tmp_path / "run")
    got = cp_results[len(CP_CASES)]
    assert got["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5)
    assert got["losses"][1] != got["losses"][0] and got["grads"].keys() == reference["grads"].keys()


RUN = [*LORA, "train.lora.dropout=0.1", "train.lr=3e-3", "checkpoint.every=2", "checkpoint.keep_last=5"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """4 steps of a LoRA run (dropout on: the resume must restore its RNG), checkpoints at 2 and 4, merged export."""
    out = tmp_path_factory.mktemp("lora_run")
    result = run_cli("extend", *set_args(small_run(4, out, *RUN)))
    assert result.returncode == 0, result.stderr + result.stdout
    return only_run_dir(out)


def test_lora_checkpoints_hold_what_trains_and_resume_reproduces_the_losses(lora_run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(lora_run / "checkpoints" / "step_000004" / "dcp")).read_metadata()
    model_items = [name for name in saved.state_dict_metadata if name.startswith("model.")]
    others = [n for n in model_items if not (".lora_" in n or "embed_tokens" in n or "norm" in n)]
    assert model_items and others == ["model.hf.lm_head.weight"]  # tied to the embeddings
    assert any("optimizer.state" in n and ".lora_A." in n for n in saved.state_dict_metadata)

    resumed = tmp_path / "resumed"
    shutil.copytree(lora_run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    shutil.rmtree(resumed / "export")
    (resumed / "summary.json").unlink()
    result = run_cli("extend", "--resume", str(resumed))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "at step 2" in result.stdout
    expected, got = step_losses(lora_run), step_losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step] == expected[step], step


def test_merged_export_is_a_plain_model_with_the_adapted_models_logits(lora_run):
    export = lora_run / "export"
    with safe_open(str(export / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert names and not any("lora_" in n or "base_layer" in n for n in names)
    merged = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()

    config = load_config(str(lora_run / "config.yaml"))
    adapted = build_model(config, load_tokenizer(config), torch.device("cpu"))
    apply_lora(adapted, config.train.lora)
    load_model_weights(lora_run / "checkpoints" / "step_000004", adapted)
    adapted.eval()
    input_ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), AttentionRouter():
        expected = adapted(input_ids=input_ids).logits
    with torch.no_grad():
        got = merged(input_ids=input_ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # a LoRA checkpoint evaluates as the same merged model
    from_checkpoint = load_model(lora_run / "checkpoints" / "step_000004", torch.device("cpu")).model
    with torch.no_grad():
        torch.testing.assert_close(from_checkpoint(input_ids=input_ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_an_adapter_export_evaluates_on_its_base(tmp_path):
    base = save_tiny_model("qwen2", tmp_path / "base", context=64, seed=3)
    out = tmp_path / "runs"
    overrides = small_run(2, out, "train.lora.rank=4", "train.lora.export=adapter", "train.lr=3e-3")
    overrides = [o for o in overrides if not o.startswith("model.")]
    data = ["--data", str(Path(__file__).parents[1] / "data" / "corpus" / "long.jsonl")]
    result = run_cli("extend", "--model", str(base), *data, *set_args(overrides))
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(out)
    export = run_dir / "export"
    assert (export / "adapter_config.json").is_file() and not (export / "config.json").is_file()
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    assert json.loads((export / "base_config.json").read_text())["max_position_embeddings"] == 256  # extended

    input_ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    from_adapter = load_model(run_dir, torch.device("cpu"))
    from_checkpoint = load_model(run_dir / "checkpoints" / "step_000002", torch.device("cpu"))
    assert from_adapter.source == "run export (LoRA adapter)"
    with torch.no_grad():
        got = from_adapter.model(input_ids=input_ids).logits
        torch.testing.assert_close(got, from_checkpoint.model(input_ids=input_ids).logits, rtol=1e-4, atol=1e-5)
        base_logits = AutoModelForCausalLM.from_pretrained(str(base)).eval()(input_ids=input_ids).logits
    assert not torch.allclose(got, base_logits, atol=1e-3)  # the adapter changed the model

    evaluated = run_cli(
        "eval", str(export), "--suite", "infinitebench", "--tasks", "passkey", "--lengths", "256", "--samples", "1",
        "--out", str(tmp_path / "eval"),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr + evaluated.stdout


def test_lora_vs_full_reads_both_reports_side_by_side():
    from bench.lora_vs_full import compare, markdown

    def report(dense: dict, sparse: dict, extend_set: list[str]) -> dict:
        ppl = {"dense": {"perplexity": dense}, "sparse": {"perplexity": sparse}}
        return {"extend_steps": 150, "gpu_name": "H200", "extend_set": extend_set, "quality": {"table": ppl}}

    full = report({"4096": 10.0, "65536": 8.0}, {"4096": 10.1, "65536": 8.1}, [])
    lora = report({"4096": 10.4, "65536": 8.6}, {"4096": 10.5, "65536": 8.5}, ["train.lora.rank=64"])
    result = compare(full, lora)
    assert [round(row["gap"], 4) for row in result["rows"]["dense"]] == [0.04, 0.075]
    assert result["meets_floor"] is False and "misses the floor" in markdown(result)
    lora["quality"]["table"]["dense"]["perplexity"]["65536"] = 8.3
    assert compare(full, lora)["meets_floor"] is True
    with pytest.raises(SystemExit, match="trained 150 and 100 steps"):
        compare(full, {**lora, "extend_steps": 100})


def test_the_model_line_says_what_was_built_and_what_trains(tmp_path):
    config = load_config("tiny", [*BASE, f"run.output_dir={tmp_path}"])
    out = io.StringIO()
    trainer = build_trainer(config, tmp_path, Console(file=out, width=200), init_parallel(config))
    params = list(trainer.model.parameters())
    num_params, num_trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    assert 0 < num_trained < num_params
    assert f"model: {num_params:,} parameters ({num_trained:,} trained) · ready on cpu in " in out.getvalue()


def test_the_8b_benchmarks_tokenizer_has_llamas_vocabulary_and_tokenises_as_shipped(tmp_path):
    from transformers import AutoTokenizer

    from bench.lora_8b import REPO, VOCAB, big_tokenizer

    shipped = AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizer"))
    big = AutoTokenizer.from_pretrained(str(big_tokenizer(tmp_path)))
    text = "def lookup(table, key):\n    return table.get(key)  # <|endoftext|> ünïcode"
    assert len(big) == VOCAB and len(set(big.get_vocab().values())) == VOCAB
    assert big(text)["input_ids"] == shipped(text)["input_ids"]
    assert big.eos_token_id == shipped.eos_token_id


def test_lora_on_a_bf16_base_keeps_the_hidden_states_in_bf16(tmp_path):
    """The embeddings train in fp32 over a bf16 base: their output is cast back, so the residual stream, and the
    layer inputs that activation checkpointing keeps, are bf16 (fp32 would double them: 16 GiB more at 8B, 64K)."""
    config = load_config("tiny", [*BASE, f"run.output_dir={tmp_path}"])
    assert config.train.lora.train_embeddings_norms
    model = build_model(config, load_tokenizer(config), torch.device("cpu"))
    apply_lora(model, config.train.lora, torch.bfloat16)
    embeddings = model.get_input_embeddings()
    assert embeddings.weight.dtype == torch.float32 and embeddings.weight.requires_grad
    layer_inputs = []
    model.model.layers[1].register_forward_pre_hook(
        lambda _m, args, kwargs: layer_inputs.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
    )
    input_ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), AttentionRouter(), torch.autocast("cpu", dtype=torch.bfloat16):  # as on a GPU
        model(input_ids=input_ids)
    assert [x.dtype for x in layer_inputs] == [torch.bfloat16]

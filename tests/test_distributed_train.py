"""Distributed `mtrain extend` under gloo: FSDP2 × context parallelism gives the single-process loss and
gradients after a step (dp, cp, dp × cp, hierarchical; dense and sparse with a full pattern; Qwen2, Llama,
Llama 3.1's llama3 RoPE, Qwen3 and Mistral, packed multi-document rows); kill-and-resume on 4 ranks reproduces
the losses; a 4-rank checkpoint resumes on 2, a 1-process one on 2 and back; the export loads; a local model
(sharded bf16 safetensors, tied embeddings) is read per rank, and its export keeps the user's files;
mismatched meshes are one-line errors."""

from __future__ import annotations

import gc
import io
import json
import math
import os
import shutil
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console
from spawned_ranks import CLIRanks, free_port, launch, run_cli_ranks
from tiny_setup import only_run_dir, route_counts, run_cli, set_args, small_run, step_losses
from transformers import AutoModelForCausalLM

from mtrain_cli.config import load_config
from mtrain_cli.resources import shipped_path
from mtrain_cli.train.checkpoint import checkpoint_dirs
from mtrain_cli.train.distributed import init_parallel
from mtrain_cli.train.loop import build_trainer

TOKENIZER_DIR = str(shipped_path("data/tokenizer"))
# p = 1 keeps every probed offset and column: the full pattern, so sparse must equal dense
FULL_SPARSE = [
    "attention.mode=sparse",
    "attention.p=1.0",
    "attention.cap=100000",
    "attention.dense_below=0",
    "attention.block_size=32",
    "attention.last_q=32",
    "attention.local_window=32",
]


def one_step(overrides: list[str], out: Path, rows: int) -> dict:
    """Loss and full gradients of one training step (in this process, or as one rank of a launch)."""
    config = load_config("tiny", [*overrides, f"run.output_dir={out}"])
    pc = init_parallel(config)
    trainer = build_trainer(config, out, Console(file=io.StringIO()), pc)
    trainer.data.loader.shuffle = False  # global batch g = rows g·b .. : dp ranks split exactly those rows
    captured: dict[str, torch.Tensor] = {}

    def capture(**_):  # called right after optimizer.step(): gradients are still there
        for name, p in trainer.model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            captured[name] = grad.detach().clone()

    trainer.optimizer.zero_grad = capture
    result = trainer.train_step()
    return {"loss": result.loss, "grads": captured, "layers": result.attention.get("layers")}


def _rank_main(rank: int, world: int, cases: list[tuple[int, list[str], str, int]]) -> None:
    """One rank of a launch that runs `cases` in turn: (port, overrides, out, node size), each in its own process
    group (its mesh and ring differ)."""
    # one intra-op thread, as torchrun gives each rank: a first MKL vector math call on several threads at once can
    # take a low-accuracy kernel (pytorch/pytorch#188792; tests/conftest.py)
    torch.set_num_threads(1)
    for port, overrides, out, node_size in cases:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LOCAL_WORLD_SIZE=str(node_size),
        )
        try:
            result = one_step(overrides, Path(out), 1)
            if rank == 0:
                torch.save(result, Path(out) / "result.pt")
        except Exception:
            (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
            raise
        finally:
            gc.collect()  # the trainer's FSDP state goes before the groups: see train.distributed.end_parallel
            if dist.is_initialized():
                dist.destroy_process_group()


BASE = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.max_position_embeddings=64",
    "context.factor=4",
    "data.seq_len=256",
    "data.num_val_rows=2",
    "train.num_steps=4",
    "train.warmup_steps=1",
    "train.grad_clip=0",
    "attention.block_size=32",
]


QWEN3 = ["model.architecture=qwen3", "model.head_dim=32"]  # q/k norms; head dim 2 × hidden/heads
PHI3 = ["model.architecture=phi3", "context.method=theta", "context.rope_theta=4e4"]  # fused qkv; no YaRN
LLAMA3 = [
    "model.architecture=llama",
    "model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
    "original_max_position_embeddings: 16}",
]


ONE_STEP_CASES = [
    (2, 1, []),
    (1, 2, []),
    (2, 2, []),
    (1, 4, ["parallel.hierarchical=true", "parallel.node_size=2"]),
    (1, 2, ["parallel.layout=stripe"]),  # dense runs default to zigzag (library pairs); stripe runs our kernels
    (1, 2, FULL_SPARSE),
    (2, 2, FULL_SPARSE),
    (1, 2, ["model.architecture=llama"]),
    (2, 2, ["model.architecture=llama", *FULL_SPARSE]),
    (1, 2, [*FULL_SPARSE, "train.activation_checkpointing=true"]),  # the ring plan survives the recompute
    (1, 2, QWEN3),
    (1, 2, [*QWEN3, *FULL_SPARSE]),
    (1, 2, ["model.architecture=mistral"]),
    (1, 2, ["model.architecture=mistral", *FULL_SPARSE]),
    (1, 2, [*LLAMA3, *FULL_SPARSE]),  # YaRN over a llama3 model's pretraining context
    (1, 2, PHI3),
    (1, 2, [*PHI3, *FULL_SPARSE]),
    (1, 2, ["attention.mode=sparse", "attention.dense_below=100000"]),  # no long document: the dense ring
    (1, 2, [*FULL_SPARSE, "attention.dense_layers=[0]"]),  # layer 0 on the dense ring, layer 1 sparse
    (1, 2, [*FULL_SPARSE, "attention.dense_every=1"]),  # a dense step: every layer on the dense ring
]


@pytest.fixture(scope="module")
def local_models(tmp_path_factory) -> dict[str, Path]:
    """Models as users bring them, saved in several safetensors files with an index: a float32 Qwen2 built from
    BASE's shape (tied embeddings), and a Qwen3 as it ships (bf16, chat template, generation_config.json)."""
    from mtrain_cli.model.build import _fresh_config, load_tokenizer
    from mtrain_cli.model.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("models")
    config = load_config("tiny", [*BASE, f"model.tokenizer={TOKENIZER_DIR}"])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(_fresh_config(config.model, len(load_tokenizer(config))))
    model.save_pretrained(root / "qwen2", max_shard_size="100KB")
    qwen3 = save_tiny_model("qwen3", root / "qwen3", dtype=torch.bfloat16, max_shard_size="100KB", seed=5)
    return {"qwen2": root / "qwen2", "qwen3": qwen3}


def local_model_overrides(model_dir: Path) -> list[str]:
    tokenizer = [f"model.tokenizer={TOKENIZER_DIR}"] if model_dir.name == "qwen2" else []
    return [*BASE, f"model.path={model_dir}", *tokenizer]


@pytest.fixture(scope="module")
def launched_steps(tmp_path_factory, local_models) -> dict[int | str, dict]:
    """Rank 0's one-step result of every case, by index, and of each local model under dp 2, by its name. The
    cases of a world size run in one launch, one after the other: starting the processes is most of a case's
    time."""
    cases_by_world: dict[int, list[tuple[int | str, list[str], int]]] = {}
    for index, (dp, cp, extra) in enumerate(ONE_STEP_CASES):
        node_size = 2 if "parallel.hierarchical=true" in extra else dp * cp
        overrides = [*BASE, *extra, f"parallel.dp={dp}", f"parallel.cp={cp}"]
        cases_by_world.setdefault(dp * cp, []).append((index, overrides, node_size))
    for name, model_dir in local_models.items():
        cases_by_world[2].append((name, [*local_model_overrides(model_dir), "parallel.dp=2"], 2))
    results = {}
    for world, world_cases in sorted(cases_by_world.items()):
        out = tmp_path_factory.mktemp(f"world{world}")
        cases = []
        for key, overrides, node_size in world_cases:
            (out / str(key)).mkdir()
            cases.append((free_port(), overrides, str(out / str(key)), node_size))
        try:
            launch(_rank_main, world, world, cases)
        except Exception as exc:
            errors = "\n".join(p.read_text() for p in sorted(out.glob("*/error*.txt")))
            pytest.fail(f"{exc}\n{errors}")
        results.update({key: torch.load(out / str(key) / "result.pt") for key, *_ in world_cases})
    return results


@pytest.mark.parametrize("case", range(len(ONE_STEP_CASES)), ids=lambda i: "-".join(map(str, ONE_STEP_CASES[i][:2])))
def test_one_step_equals_single_process(case, launched_steps, tmp_path):
    dp, _cp, extra = ONE_STEP_CASES[case]
    single_extra = [item for item in extra if not item.startswith("parallel.")]
    reference = one_step([*BASE, *single_extra, f"train.batch_size={dp}"], tmp_path / "single", dp)
    _assert_same_step(launched_steps[case], reference)
    # the ring routes each layer as one process does, and counts it the same way
    assert launched_steps[case]["layers"] == reference["layers"]
    if "attention.dense_every=1" in extra:
        assert reference["layers"] == route_counts({"dense-step": 2})
    elif "attention.dense_layers=[0]" in extra:
        assert reference["layers"] == route_counts({"sparse": 1, "dense-layer": 1})
    elif "attention.dense_below=100000" in extra:
        assert reference["layers"] == route_counts({"dense-short-documents": 2})
    elif "attention.mode=sparse" in extra:
        assert reference["layers"] == route_counts({"sparse": 2})


def _assert_same_step(got: dict, reference: dict) -> None:
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_four_ranks_killed_and_resumed_reproduce_the_losses_and_resume_on_two(tmp_path):
    num_steps = 6
    args = [
        *BASE[:-3],
        f"train.num_steps={num_steps}",
        "train.warmup_steps=1",
        "attention.block_size=32",
        "parallel.dp=2",
        "parallel.cp=2",
        "checkpoint.every=2",
        "logging.every=1",
        "train.eval_every=100",
    ]
    # the losses of the uninterrupted run from one process on the same rows (2 micro-batches of 1 row for dp 2):
    # dp 2 × cp 2 sum the loss and gradients in another order, equal up to rounding (measured: 8e-8 relative)
    one_process = [*(a for a in args if not a.startswith("parallel.")), "train.grad_accum=2"]
    reference = run_cli("extend", *set_args([*one_process, f"run.output_dir={tmp_path / 'ref'}"]))
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = step_losses(only_run_dir(tmp_path / "ref"))
    assert sorted(expected) == list(range(1, num_steps + 1))

    out = tmp_path / "killed"
    ranks = CLIRanks(4, "extend", *set_args([*args, f"run.output_dir={out}"]))
    deadline = time.time() + 600
    while time.time() < deadline and not (
        out.exists() and any(out.iterdir()) and checkpoint_dirs(only_run_dir(out) / "checkpoints")
    ):
        time.sleep(0.5)
    ranks.kill()  # SIGKILL to every rank: no chance to save
    run_dir = only_run_dir(out)
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert saved and saved[-1][0] < num_steps, "the kill came too late to test a resume"

    resumed = run_cli_ranks(4, "extend", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, num_steps + 1))
    for step, losses in got.items():
        # a step logged before the kill and again after the resume: the same loss, on the same 4 ranks
        assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-6), (step, losses)
        assert losses[0] == pytest.approx(expected[step][0], rel=1e-5), (step, losses, expected[step])

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "export", local_files_only=True)
    assert exported.config.rope_parameters["rope_type"] == "yarn"

    # the same checkpoint on 2 ranks (dp 1 × cp 2): DCP reshards, the data position is converted, with a warning
    config = run_dir / "config.yaml"
    two = run_cli_ranks(
        2,
        "extend",
        "--recipe",
        str(config),
        "--resume",
        str(run_dir),
        *set_args(["parallel.dp=1", f"train.num_steps={num_steps + 2}"]),
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "data-parallel rank(s) on 1" in two.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"]["world"] == 2 and summary["steps"]["end"] == num_steps + 2

    # `mtrain eval` reads a sharded checkpoint in one process: the same weights as the gathered export
    from mtrain_cli.eval.loading import load_model

    last = checkpoint_dirs(run_dir / "checkpoints")[-1][1]
    ids = torch.arange(40)[None]
    with torch.no_grad():
        from_checkpoint = load_model(last, torch.device("cpu")).model(ids).logits
        from_export = load_model(run_dir / "export", torch.device("cpu")).model(ids).logits
    torch.testing.assert_close(from_checkpoint, from_export)


def test_a_one_process_run_resumes_on_two_processes_and_back(tmp_path):
    """One checkpoint format for every world size: a 1-process run's step-4 checkpoint resumes on 2 processes
    (dp 2), and their step-6 checkpoint resumes on 1 process again, to step 8.

    Both sides train on the same rows each step (1 process: grad_accum 2 micro-batches of 1 row; 2 ranks: 1 row
    each), so the losses continue those of the uninterrupted 1-process run, but need not bit for bit: 2 ranks
    sum the loss and average the gradients in another order (FSDP's reduce-scatter, the all_reduce of the
    loss), a rounding difference that AdamW carries into the weights (measured: equal up to step 7, 4e-8
    relative at step 8). Equality is asserted where the world size does not change (test_train, the 4-rank
    resume above); here a rounding-level tolerance."""
    num_steps = 8
    args = small_run(
        num_steps,
        tmp_path / "runs",
        "checkpoint.every=2",
        "checkpoint.keep_last=4",
        "checkpoint.export=false",
        "train.schedule=constant",
        "train.grad_accum=2",
    )
    first = run_cli("extend", *set_args(args), timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    expected = step_losses(run_dir)
    checkpoints = run_dir / "checkpoints"
    for step in (6, 8):  # as if killed after step 8 was logged, before those checkpoints
        shutil.rmtree(checkpoints / f"step_{step:06d}")
    (run_dir / "summary.json").unlink()

    two = run_cli_ranks(
        2, "extend", "--resume", str(run_dir), *set_args(["parallel.dp=2", "train.grad_accum=1", "train.num_steps=6"])
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "at step 4" in two.stdout and "written with 1 data-parallel rank(s) on 2" in " ".join(two.stdout.split())
    written_by_two = checkpoints / "step_000006"
    assert sorted(p.name for p in written_by_two.iterdir()) == ["dcp", "state_rank0.pt", "state_rank1.pt"]
    assert json.loads((run_dir / "summary.json").read_text())["parallel"]["world"] == 2

    one = run_cli(
        "extend",
        "--resume",
        str(run_dir),
        *set_args(["parallel.dp=1", "train.grad_accum=2", f"train.num_steps={num_steps}"]),
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "at step 6" in one.stdout and "written with 2 data-parallel rank(s) on 1" in " ".join(one.stdout.split())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parallel"]["world"] == 1 and summary["resumed_at"] == [4, 6]
    assert summary["steps"] == {"start": 6, "end": num_steps}

    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, num_steps + 1)) and all(len(losses) == 1 for losses in got.values())
    for step in range(1, 5):  # the first leg's lines, kept
        assert got[step] == expected[step]
    for step in range(5, num_steps + 1):  # 5, 6 on two processes; 7, 8 on one again
        assert math.isfinite(got[step][0])
        assert got[step][0] == pytest.approx(expected[step][0], rel=1e-5), (step, got[step], expected[step])


def test_mesh_that_does_not_match_the_launch_is_one_line():
    result = run_cli("extend", "--nproc", "2", "--set", "parallel.cp=4")
    assert result.returncode == 2 and "parallel.dp 1 × parallel.cp 4 = 4" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    single = run_cli("extend", "--set", "parallel.dp=2", *set_args(small_run(1, Path("unused"))))
    assert single.returncode == 2 and "launch 2 processes" in single.stderr


def test_local_model_is_loaded_sharded_and_trains_like_one_process(local_models, launched_steps, tmp_path):
    """`--model DIR` under 2 ranks: built on the meta device, each rank reads its rows of a multi-file
    safetensors checkpoint (tied embeddings); loss and gradients after a step equal one process loading
    the same directory with from_pretrained."""
    model_dir = local_models["qwen2"]
    assert (model_dir / "model.safetensors.index.json").is_file()  # several files: the index path is exercised
    reference = one_step([*local_model_overrides(model_dir), "train.batch_size=2"], tmp_path / "single", 2)
    _assert_same_step(launched_steps["qwen2"], reference)


def test_a_sharded_bf16_checkpoint_is_read_per_rank_and_its_export_keeps_the_users_files(
    local_models, launched_steps, tmp_path
):
    """A Qwen3 as it ships (bf16, several safetensors files and an index, tied embeddings, chat template,
    generation_config.json): 2 ranks reading their rows give one process's loss and gradients; an `--nproc 2`
    run exports it with its embeddings still tied, its template, special tokens and generation settings."""
    model_dir = local_models["qwen3"]
    assert (model_dir / "model.safetensors.index.json").is_file() and len(list(model_dir.glob("*.safetensors"))) > 1
    reference = one_step([*local_model_overrides(model_dir), "train.batch_size=2"], tmp_path / "single", 2)
    _assert_same_step(launched_steps["qwen3"], reference)

    args = [*BASE[:-3], "train.num_steps=1", "train.warmup_steps=0", "checkpoint.every=1", "parallel.dp=2"]
    data = ["--data", str(shipped_path("data/corpus/long.jsonl"))]  # a user's model trains on the user's data only
    result = run_cli_ranks(
        2, "extend", "--model", str(model_dir), *data, "--output-dir", str(tmp_path / "runs"), *set_args(args)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    export = only_run_dir(tmp_path / "runs") / "export"
    exported = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert exported.config.tie_word_embeddings and exported.lm_head.weight is exported.model.embed_tokens.weight
    assert (export / "chat_template.jinja").read_text() == (model_dir / "chat_template.jinja").read_text()
    generation = [json.loads((d / "generation_config.json").read_text()) for d in (model_dir, export)]
    for key in ("eos_token_id", "bos_token_id", "do_sample", "temperature", "top_p"):
        assert generation[1][key] == generation[0][key], key
    tokens = [json.loads((d / "tokenizer_config.json").read_text()) for d in (model_dir, export)]
    assert {k: tokens[1].get(k) for k in ("eos_token", "pad_token")} == {
        k: tokens[0].get(k) for k in ("eos_token", "pad_token")
    }

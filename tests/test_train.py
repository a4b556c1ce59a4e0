"""The single-process trainer: per-document attention, per-token loss, learning, exact resume, HF export, --model."""

from __future__ import annotations

import io
import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from spawned_ranks import ForkedCLI
from tiny_setup import only_run_dir, run_cli, set_args, small_run, step_losses
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, Qwen2Config

from mtrain_cli.attention.hook import mtrain_attention
from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.resources import shipped_path
from mtrain_cli.train.checkpoint import checkpoint_dirs, load_model_weights, read_state
from mtrain_cli.train.loop import build_trainer
from mtrain_cli.train.loss import chunked_cross_entropy
from mtrain_cli.train.run import run_extend

CPU = torch.device("cpu")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


# -- building blocks ------------------------------------------------------------------------------------------


def _ce_case(dtype=torch.float64):
    torch.manual_seed(0)
    hidden = torch.randn(2, 37, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37))
    labels[0, :5] = -100
    labels[1, -3:] = -100
    return hidden, weight, labels


def test_chunked_cross_entropy_equals_full_logits():
    """Gradients computed chunk by chunk in the forward (the last chunk ragged, ignored labels inside chunks)
    equal autograd's through the full logits, scaled by the incoming gradient as the trainer's mean does."""
    hidden, weight, labels = _ce_case()
    loss_sum, num_tokens = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    expected = F.cross_entropy((hidden @ weight.T).reshape(-1, 50), labels.reshape(-1), reduction="sum")
    assert int(num_tokens) == 2 * 37 - 8
    torch.testing.assert_close(loss_sum.double(), expected)
    grads = torch.autograd.grad(loss_sum * 0.37, (hidden, weight))
    expected_grads = torch.autograd.grad(expected * 0.37, (hidden, weight))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    with torch.no_grad():  # validation: the loss alone
        val_sum, val_tokens = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    torch.testing.assert_close(val_sum.double(), expected)
    assert int(val_tokens) == int(num_tokens)


def test_chunked_cross_entropy_under_autocast_matches_autocast_logits():
    """Under bf16 autocast the LM head runs in bf16 (as autocast's linear would) and the softmax in fp32; the
    gradients return in the parameters' fp32. Reference: autograd through autocast's bf16 logits."""
    hidden, weight, labels = _ce_case(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
        logits = F.linear(hidden, weight).float()
    expected = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss_sum, expected, rtol=1e-4, atol=1e-3)
    grads = torch.autograd.grad(loss_sum, (hidden, weight))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    for got, want in zip(grads, expected_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_attention_hook_masks_packed_documents():
    """One packed row of three documents (plus padding) equals each document attended on its own."""
    torch.manual_seed(0)
    lengths = [5, 11, 7]
    document_ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 7 + [-1] * 3])
    seq_len = document_ids.shape[1]
    q = torch.randn(1, 4, seq_len, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, seq_len, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, seq_len, 8, dtype=torch.float64, requires_grad=True)
    with AttentionRouter():
        out_BSHD, _ = mtrain_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, document_ids=document_ids)
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        expected = F.scaled_dot_product_attention(
            q[:, :, piece],
            k[:, :, piece].repeat_interleave(2, 1),
            v[:, :, piece].repeat_interleave(2, 1),
            is_causal=True,
            scale=0.3,
        )
        torch.testing.assert_close(out_BSHD[:, piece], expected.transpose(1, 2))
        start += n
    assert torch.isfinite(out_BSHD).all()


def test_packed_row_gives_the_same_logits_as_separate_documents():
    """Through the whole HF model: position ids restart and document ids mask, so packing changes nothing."""
    config = load_config("tiny", small_run(1, Path("unused")))
    model = build_model(config, load_tokenizer(config), CPU).eval()
    torch.manual_seed(1)
    docs = [torch.randint(0, 500, (n,)) for n in (9, 20, 4)]
    input_ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad(), AttentionRouter():
        packed = model(input_ids=input_ids, position_ids=position_ids, document_ids=document_ids).logits[0]
        separate = torch.cat(
            [model(input_ids=d[None], position_ids=torch.arange(len(d))[None]).logits[0] for d in docs]
        )
    torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-5)


def test_gradient_accumulation_averages_per_token(tmp_path):
    """batch 2 × accum 1 and batch 1 × accum 2 see the same rows and give the same loss and gradients."""
    grads, losses = [], []
    for batch_size, grad_accum in ((2, 1), (1, 2)):
        config = load_config(
            "tiny",
            small_run(
                1, tmp_path, f"train.batch_size={batch_size}", f"train.grad_accum={grad_accum}", "train.grad_clip=0"
            ),
        )
        trainer = build_trainer(config, tmp_path, quiet())
        trainer.data.loader.shuffle = False  # both settings take rows 0 and 1
        captured = {}
        trainer.optimizer.zero_grad = lambda **_: captured.update(  # called right after the optimizer step
            {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        )
        losses.append(trainer.train_step().loss)
        grads.append(captured)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7, msg=name)


# -- whole runs -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    config = load_config("tiny", small_run(40, out, "train.lr=3e-3", "train.warmup_steps=4"))
    result = run_extend(config, None, quiet())
    return result.run_dir


def test_loss_decreases(trained_run):
    summary = json.loads((trained_run / "summary.json").read_text())
    val = {int(k): v for k, v in summary["val_loss"].items()}
    assert val[40] < val[0] - 1.0, val
    losses = step_losses(trained_run)
    assert sum(losses[40 - i][0] for i in range(5)) < sum(losses[1 + i][0] for i in range(5)) - 5.0
    assert summary["attention_calls"]["dense"] > 0 and summary["attention_mode"] == "dense"
    assert summary["packing"]["num_tokens_dropped"] >= 0 and summary["steps"] == {"start": 0, "end": 40}
    assert summary["builds"] == {"kernels_built": 0, "plans_captured": 0, "later_steps": [], "rebuilt": []}  # CPU
    steps = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert all(m["kernels_built"] == 0 and m["plans_captured"] == 0 for m in steps if "loss" in m)


def test_export_loads_in_transformers_with_the_same_logits(trained_run):
    config = load_config(str(trained_run / "config.yaml"))
    model = build_model(config, load_tokenizer(config), CPU).eval()
    ((_, last),) = checkpoint_dirs(trained_run / "checkpoints")[-1:]
    load_model_weights(last, model)
    exported = AutoModelForCausalLM.from_pretrained(trained_run / "export", local_files_only=True).eval()

    rope = exported.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 64
    assert exported.config.max_position_embeddings == 256
    input_ids = torch.randint(0, 500, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), AttentionRouter():
        ours = model(input_ids=input_ids, document_ids=torch.zeros_like(input_ids)).logits
        theirs = exported(input_ids=input_ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (trained_run / "export" / "model.safetensors").is_file()
    assert (trained_run / "export" / "tokenizer.json").is_file()


def test_checkpoints_keep_the_last_k(tmp_path):
    config = load_config(
        "tiny", small_run(6, tmp_path, "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.export=false")
    )
    run_dir = run_extend(config, None, quiet()).run_dir
    assert [step for step, _ in checkpoint_dirs(run_dir / "checkpoints")] == [5, 6]
    # one process writes the layout of many: DCP's files and one trainer state per rank
    last = run_dir / "checkpoints" / "step_000006"
    assert sorted(p.name for p in last.iterdir()) == ["dcp", "state_rank0.pt"]
    assert sorted(p.name for p in (last / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]
    assert not list((run_dir / "checkpoints").glob("*.tmp-*"))


def test_steps_are_launched_one_ahead_of_their_reading_and_train_as_one_at_a_time(tmp_path, monkeypatch):
    """fit launches step N+1 before it reads, logs and votes on step N, except after a step that validates or
    saves (3: eval_every; 6: the last); every step trains as train_step, one at a time, does: the same losses
    and gradient norms, the same validation and final weights."""
    from mtrain_cli.train.metrics import LaunchedStep

    config = load_config("tiny", small_run(6, tmp_path, "train.eval_every=3", "checkpoint.export=false"))
    (tmp_path / "ahead").mkdir()
    trainer = build_trainer(config, tmp_path / "ahead", quiet())
    events: list[str] = []
    launch, read = trainer.launch_step, LaunchedStep.result

    def launch_step():
        launched = launch()
        events.append(f"L{launched.step}")
        return launched

    def result(launched):
        events.append(f"R{launched.step}")
        return read(launched)

    trainer.launch_step = launch_step
    monkeypatch.setattr(LaunchedStep, "result", result)
    summary = trainer.fit()
    assert " ".join(events) == "L1 L2 R1 L3 R2 R3 L4 L5 R4 L6 R5 R6"
    monkeypatch.undo()

    one_at_a_time = build_trainer(config, tmp_path / "one", quiet())
    results = [one_at_a_time.train_step() for _ in range(6)]
    logged = [json.loads(line) for line in (tmp_path / "ahead" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in steps] == [r.loss for r in results]
    assert [r["grad_norm"] for r in steps] == [r.grad_norm for r in results]
    assert set(summary["val_loss"]) == {"0", "3", "6"}
    assert summary["val_loss"]["6"] == one_at_a_time.validation_loss()
    for (name, a), b in zip(trainer.model.named_parameters(), one_at_a_time.model.parameters()):
        assert torch.equal(a, b), name
    assert all(r["step_s"] > 0 for r in steps)


def test_a_step_queued_behind_another_counts_its_time_from_the_others_end():
    """On CUDA a launched step's seconds run on the GPU's timeline: from the end of the step it queued behind
    (launched before that one was read), else from its own launch. On CPU the launch ran the step."""
    from mtrain_cli.attention import PendingStats
    from mtrain_cli.train import metrics

    class Event:  # a recorded CUDA event: milliseconds on the GPU's clock
        def __init__(self, ms: float):
            self.ms, self.waited = ms, False

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, end: Event) -> float:
            return end.ms - self.ms

    def launched(**clock):
        loss_sum, norm = torch.tensor([4.0], dtype=torch.float64), torch.tensor(0.5)
        stats = PendingStats(None, None, [], [], {}, False)
        return metrics.LaunchedStep(4, [], 8, 1e-3, loss_sum, norm, stats, {}, **clock)

    done = Event(9000.0)
    behind = launched(started=10.0, ended=10.5, begun=Event(7500.0), behind=Event(8000.0), done=done).result()
    assert (behind.seconds, behind.loss, behind.grad_norm, behind.step, done.waited) == (1.0, 0.5, 0.5, 4, True)
    alone = launched(started=10.0, ended=10.5, begun=Event(7500.0), done=Event(9000.0)).result()
    assert alone.seconds == 1.5
    assert launched(started=10.0, ended=10.25).result().seconds == 0.25


def test_steps_launched_ahead_each_count_their_own_time(tmp_path, monkeypatch):
    """`run_steps` reads a step after launching the next: each step's seconds are still its own (on CPU the launch
    runs the step; a read's clock would give one step both launches and the other none)."""
    config = load_config("tiny", small_run(3, tmp_path, "checkpoint.export=false"))
    trainer = build_trainer(config, tmp_path / "run", quiet())
    loss_sum = trainer._loss_sum

    def slow_loss_sum(batch):
        time.sleep(0.2)
        return loss_sum(batch)

    monkeypatch.setattr(trainer, "_loss_sum", slow_loss_sum)
    results = trainer.run_steps(3)
    assert [r.step for r in results] == [1, 2, 3]
    assert all(r.seconds >= 0.2 for r in results), [r.seconds for r in results]


def test_next_step_batches_are_fetched_during_a_step_and_a_checkpoint_keeps_its_position(tmp_path):
    """A step fetches the next step's rows (the last step does not); a checkpoint written meanwhile records the
    position before them, and the next step trains on exactly them."""
    config = load_config("tiny", small_run(3, tmp_path, "checkpoint.export=false"))
    trainer = build_trainer(config, tmp_path / "run", quiet())
    replay = build_trainer(config, tmp_path / "replay", quiet()).data.loader
    expected = [next(replay) for _ in range(3)]
    trainer.train_step()
    assert trainer.data.loader.state_dict()["index"] == 2 and trainer._next is not None
    assert all(torch.equal(trainer._next.rows[0][k], expected[1][k]) for k in expected[1])
    state = read_state(trainer.save())
    assert state.step == 1 and state.loader == {"epoch": 0, "index": 1}
    trainer.train_step()
    trainer.train_step()
    assert trainer._next is None and trainer.data.loader.state_dict()["index"] == 3  # nothing after the last step
    assert read_state(trainer.save()).loader == {"epoch": 0, "index": 3}


def _start(out: Path, num_steps: int, *extra: str) -> ForkedCLI:
    return ForkedCLI("extend", *set_args(small_run(num_steps, out, "checkpoint.export=false", *extra)))


def _wait_for_steps(out: Path, num_steps: int, process: ForkedCLI) -> Path:
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        run_dirs = [p for p in out.iterdir() if p.is_dir()]
        if run_dirs and (run_dirs[0] / "metrics.jsonl").exists() and len(step_losses(run_dirs[0])) >= num_steps:
            return run_dirs[0]
        time.sleep(0.01)
    raise AssertionError(f"run did not reach step {num_steps}: {process.communicate()[0][-2000:]}")


RESUME_STEPS = 60


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory) -> dict[int, list[float]]:
    """The losses of a run of RESUME_STEPS that nothing stopped: what every interrupted run must reproduce."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    result = run_cli("extend", *set_args(small_run(RESUME_STEPS, reference, "checkpoint.export=false")))
    assert result.returncode == 0, result.stderr
    return step_losses(only_run_dir(reference))


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9"])
def test_killed_and_resumed_run_reproduces_the_uninterrupted_losses(tmp_path, how, uninterrupted_losses):
    num_steps, expected = RESUME_STEPS, uninterrupted_losses

    out = tmp_path / "interrupted"
    out.mkdir()
    process = _start(out, num_steps, "checkpoint.every=2")
    run_dir = _wait_for_steps(out, 3, process)
    process.send_signal(signal.SIGINT if how == "ctrl-c" else signal.SIGKILL)
    log = process.communicate(timeout=120)[0]
    saved = checkpoint_dirs(run_dir / "checkpoints")
    stopped_at = max(step_losses(run_dir))
    if how == "ctrl-c":
        assert process.returncode == 130, log
        assert "checkpoint saved" in log and f"mtrain extend --resume {run_dir}" in log
        assert saved[-1][0] == stopped_at, "Ctrl-C must checkpoint the last finished step"
    else:
        assert process.returncode == -signal.SIGKILL
    assert stopped_at < num_steps, "the signal arrived too late to test a resume"

    resumed = run_cli("extend", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    assert f"at step {saved[-1][0]}" in resumed.stdout
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, num_steps + 1))
    for step, losses in got.items():
        assert all(loss == expected[step][0] for loss in losses), (step, losses, expected[step])


# -- real models from a local directory -----------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [Qwen2Config, LlamaConfig])
def test_model_directory_is_loaded_and_extended(tmp_path, config_class):
    tokenizer = load_tokenizer(load_config("tiny"))
    model_dir = tmp_path / "model"
    hf_config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    torch.manual_seed(3)
    source = AutoModelForCausalLM.from_config(hf_config)
    source.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    result = run_cli(
        "extend",
        "--model",
        str(model_dir),
        "--data",
        str(shipped_path("data/corpus/long.jsonl")),
        "--output-dir",
        str(tmp_path / "runs"),
        *set_args([*small_run(2, tmp_path / "runs"), "context.factor=2"]),
    )
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "export", local_files_only=True)
    assert exported.config.model_type == hf_config.model_type
    assert exported.config.rope_parameters["original_max_position_embeddings"] == 128
    assert exported.config.rope_parameters["rope_theta"] == 50000.0
    assert exported.config.max_position_embeddings == 256

    # The run started from the saved weights, not from a fresh initialisation.
    config = load_config(str(run_dir / "config.yaml"))
    trainer = build_trainer(config, tmp_path, quiet())
    for name, tensor in source.state_dict().items():
        torch.testing.assert_close(trainer.model.state_dict()[name], tensor, msg=name)


def test_unsupported_architecture_is_one_line(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=600)).save_pretrained(tmp_path / "gpt2")
    load_tokenizer(load_config("tiny")).save_pretrained(tmp_path / "gpt2")
    config = load_config("tiny", [f"model.path={tmp_path / 'gpt2'}"])
    message = "model_type 'gpt2'; mtrain extends Qwen2/Qwen2.5 (qwen2), Qwen3 (qwen3), Llama 2/3.x (llama), Mistral"
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model(config, load_tokenizer(config), CPU)


def test_sharded_loading_of_a_mismatched_directory_is_one_line(tmp_path):
    """The meta-device path reads weights by name and shape: a checkpoint of another size fails clearly."""
    from mtrain_cli.train.hf_weights import load_sharded_weights

    tokenizer = load_tokenizer(load_config("tiny"))
    small = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    config = load_config("tiny", [f"model.path={tmp_path / 'model'}"])
    model = build_model(config, tokenizer, torch.device("meta"))
    load_sharded_weights(model, tmp_path / "model", CPU)  # same shapes: loads (rows 0..n of an unsharded model)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.zero_()
    load_sharded_weights(model, tmp_path / "model", CPU)
    assert float(model.model.layers[0].mlp.up_proj.weight.detach().abs().sum()) > 0  # read again from the file
    # a directory whose config.json says 2 layers but whose weights are the 1-layer model's
    two = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    two.save_pretrained(tmp_path / "mixed")
    tokenizer.save_pretrained(tmp_path / "mixed")
    shutil.copy(tmp_path / "model" / "model.safetensors", tmp_path / "mixed" / "model.safetensors")
    config = load_config("tiny", [f"model.path={tmp_path / 'mixed'}"])
    model = build_model(config, tokenizer, torch.device("meta"))
    with pytest.raises(UserError, match=r"weight 'model.layers.1.[a-z_.]+' is missing from its safetensors files"):
        load_sharded_weights(model, tmp_path / "mixed", CPU)


def test_seq_len_beyond_a_model_directory_context_is_one_line(tmp_path):
    """A local model's context is only known from its config.json: checked before any data is packed."""
    tokenizer = load_tokenizer(load_config("tiny"))
    hf_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = run_cli(
        "extend",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(shipped_path("data/corpus/long.jsonl")),
        "--output-dir",
        str(tmp_path / "runs"),
        *set_args([*small_run(1, tmp_path / "runs"), "context.factor=2", "data.seq_len=512"]),
    )
    assert result.returncode == 2, result.stderr
    assert "data.seq_len 512 exceeds the extended context 256 of --model" in result.stderr
    assert "context.factor 4" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "packed" not in result.stdout  # stopped before the data was read


def test_a_fresh_model_under_a_launch_is_initialised_on_the_cores_of_its_rank(monkeypatch):
    """torchrun leaves each rank one thread; a fresh model's CPU init takes the node's cores shared among its
    ranks, then gives them back, and draws the same weights as at one thread (ranks and one process agree)."""
    from mtrain_cli.train.parts import cpu_threads, threads_per_local_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert threads_per_local_rank() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert threads_per_local_rank() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert threads_per_local_rank() == 64

    config = load_config("tiny", small_run(1, Path("unused")))
    before = torch.get_num_threads()
    weights = {}
    for num_threads in (1, 3):
        with cpu_threads(num_threads):
            assert torch.get_num_threads() == num_threads
            weights[num_threads] = build_model(config, load_tokenizer(config), CPU).state_dict()
        assert torch.get_num_threads() == before
    assert all(torch.equal(weights[1][name], weights[3][name]) for name in weights[1])

"""`train.compile`: each decoder layer compiled in place, one graph shared by all layers, attention eager in
between; training matches eager (with and without activation checkpointing); a silent fallback to eager is
a warning in the summary; bad values are one line with exit code 2.

On CPU inductor compiles C++ (tens of seconds on 2 cores with a cold cache): those tests are marked slow."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_setup import run_cli, small_run
from torch._dynamo.utils import counters

from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.train.compile import compile_layers, is_compiled, should_compile
from mtrain_cli.train.loop import Trainer, build_trainer
from mtrain_cli.train.run import run_extend

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo caches compiled code per code object for the whole process: each test starts empty."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_compile_is_true_false_or_auto():
    assert load_config("tiny").train.compile is None
    for text, value in (("true", True), ("false", False), ("auto", None), ("null", None)):
        assert load_config("tiny", [f"train.compile={text}"]).train.compile is value
    assert should_compile(None, torch.device("cuda")) and not should_compile(None, CPU)
    assert should_compile(True, CPU) and not should_compile(False, torch.device("cuda"))
    with pytest.raises(UserError, match=r"^train.compile 'maybe' must be true, false or auto$"):
        load_config("tiny", ["train.compile=maybe"])


def test_bad_compile_value_is_one_line_with_exit_code_2(tmp_path):
    result = run_cli("extend", "--set", "train.compile=2", "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: train.compile 2 must be true, false or auto"], result.stderr


@pytest.mark.slow
def test_layers_share_one_compiled_graph_and_attention_runs_eagerly():
    config = load_config("tiny", small_run(1, Path("unused")))
    model = build_model(config, load_tokenizer(config), CPU)
    layers = model.model.layers
    assert compile_layers(model) == len(layers) == 2
    assert all(is_compiled(layer) for layer in layers)
    assert all(not name.count("_orig_mod") for name in model.state_dict())  # checkpoints and export unchanged

    hidden = torch.randn(1, 256, 64, requires_grad=True)  # the training shape: inductor reuses these kernels
    position_ids = torch.arange(256)[None]
    inputs = dict(
        attention_mask=None,
        position_ids=position_ids,
        document_ids=torch.zeros_like(position_ids),
        position_embeddings=model.model.rotary_emb(hidden, position_ids),
    )
    router = AttentionRouter()
    before = router.calls().get("dense", 0)
    with router:
        layers[0](hidden, **inputs).sum().backward()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs > 0
        layers[1](hidden, **inputs).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs, "the second layer compiled graphs of its own"
    assert router.calls().get("dense", 0) == before + 2  # the hook ran in Python, once per layer call
    reasons = list(counters["graph_break"])
    assert reasons and all("torch.compiler.disable()" in r and "mtrain_attention" in r for r in reasons), reasons


def _losses(config, out: Path, num_steps: int) -> tuple[list[float], Trainer]:
    trainer = build_trainer(config, out, quiet())
    return [trainer.train_step().loss for _ in range(num_steps)], trainer


@pytest.mark.slow
@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_compiled_training_matches_eager(tmp_path, activation_checkpointing):
    """fp32: the compiled graphs fuse RMSNorm, rotary, SiLU and residual adds, so results differ from eager in
    the last bit of some elements; three AdamW steps on this model stay within 1e-7 relative. rel 1e-5 keeps
    a wide margin and still catches real errors (a wrong mask or a skipped layer moves the loss by > 1e-2)."""
    overrides = small_run(3, tmp_path, f"train.activation_checkpointing={str(activation_checkpointing).lower()}")
    eager, trainer = _losses(load_config("tiny", [*overrides, "train.compile=false"]), tmp_path, 3)
    assert not trainer.net.compiled and counters["stats"]["unique_graphs"] == 0
    compiled, trainer = _losses(load_config("tiny", [*overrides, "train.compile=true"]), tmp_path, 3)
    assert trainer.net.compiled and all(is_compiled(layer) for layer in trainer.model.model.layers)
    # Training alone ran (no validation): graphs here are training graphs. Under activation checkpointing,
    # torch's checkpoint disables dynamo inside, which would leave the layers eager without compile.py's fix.
    assert counters["stats"]["unique_graphs"] > 0
    assert compiled == pytest.approx(eager, rel=1e-5)


@pytest.mark.slow
def test_fallback_to_eager_is_a_warning_in_the_summary(tmp_path):
    """Dynamo's recompile limit (here 1: validation at step 0 runs in eval mode, training then needs a second
    compile) makes it run the function eagerly without an error: the run says so."""
    config = load_config("tiny", small_run(2, tmp_path, "train.compile=true", "checkpoint.export=false"))
    with torch._dynamo.config.patch(recompile_limit=1):
        summary = run_extend(config, None, quiet()).summary
    assert summary["compile"] is True
    assert any(
        "train.compile: dynamo stopped compiling" in w and "recompile_limit" in w for w in summary["warnings"]
    ), summary["warnings"]


@pytest.mark.slow
def test_compiled_lora_training_with_activation_checkpointing_matches_eager(tmp_path):
    """LoRA's adapters (peft's Linear around each frozen projection) compile inside the layers: no graph break but
    at our compiler-disabled functions (attention, and the checkpoint region compile.py runs eagerly), and the
    losses of eager training."""
    overrides = small_run(2, tmp_path, "train.activation_checkpointing=true", "train.lora.rank=4", "train.lr=3e-3")
    eager, _ = _losses(load_config("tiny", [*overrides, "train.compile=false"]), tmp_path, 2)
    compiled, trainer = _losses(load_config("tiny", [*overrides, "train.compile=true"]), tmp_path, 2)
    assert trainer.net.compiled and counters["stats"]["unique_graphs"] > 0
    reasons = list(counters["graph_break"])
    ours = ("mtrain_attention", "_checkpoint_compiled")
    assert reasons and all("torch.compiler.disable()" in r and any(f in r for f in ours) for r in reasons), reasons
    assert compiled == pytest.approx(eager, rel=1e-5)

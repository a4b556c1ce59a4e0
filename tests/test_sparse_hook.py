"""Sparse attention through the model hook and the trainer: same loss as dense on a full pattern, plans
computed once per layer under activation checkpointing, the CLI path, config errors, and attention only
inside an entered router, each keeping its own records."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from tiny_setup import route_counts, run_cli, set_args, small_run

from mtrain_cli.attention.hook import compute_dtype, mtrain_attention
from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.config import config_from_dict, load_config, to_yaml
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.train.loop import build_trainer

CPU = torch.device("cpu")
# p = 1 keeps every offset and column with probe mass: on one-document probes that is the full pattern
FULL = AttentionConfig(
    mode="sparse", pattern="flex", p=1.0, cap=10**6, last_q=16, block_size=16, local_window=16, dense_below=0
)


def packed_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [37, 51, 24]
    input_ids = torch.randint(0, 300, (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return {"input_ids": input_ids, "position_ids": position_ids, "document_ids": document_ids}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, batch["input_ids"][0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("engine", ["reference", "triton"])
def test_full_pattern_gives_the_dense_loss_and_gradients(engine):
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=1"))
    model = build_model(config, load_tokenizer(config), CPU)
    batch = packed_batch()
    with AttentionRouter():
        dense_loss, dense_grads = loss_and_grads(model, batch)
    with AttentionRouter(FULL, engine=engine) as router:
        before = router.calls().get(f"sparse-{engine}", 0)
        sparse_loss, sparse_grads = loss_and_grads(model, batch)
    assert router.calls()[f"sparse-{engine}"] == before + 1  # the sparse path really ran
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-5, atol=1e-6)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(sparse_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_batch_without_a_long_document_runs_dense_attention_and_counts_it(tmp_path):
    """Documents shorter than dense_below attend densely inside their own blocks: on a packed batch of only such
    documents the router runs dense attention itself (the dense loss and gradients, no plan), counted as its own
    path; a document of dense_below tokens in the batch brings the plan back."""
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=2"))
    model = build_model(config, load_tokenizer(config), CPU)
    batch = packed_batch()  # documents of 37, 51 and 24 tokens
    with AttentionRouter():
        dense_loss, dense_grads = loss_and_grads(model, batch)
    with AttentionRouter(dataclasses.replace(FULL, dense_below=52), engine="reference") as router:
        short_loss, short_grads = loss_and_grads(model, batch)
    assert router.calls() == {"dense-short-documents": 2}
    stats = router.sparse_stats()
    assert stats["layers"] == route_counts({"dense-short-documents": 2})
    assert stats["attention_work"] == 1.0 and "sparse_recall" not in stats
    torch.testing.assert_close(short_loss, dense_loss, rtol=0, atol=0)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(short_grads[name], grad, rtol=0, atol=0, msg=name)
    with AttentionRouter(dataclasses.replace(FULL, dense_below=51), engine="reference") as router:
        loss_and_grads(model, batch)
    assert router.calls() == {"sparse-reference": 2}

    # in training: each step's metrics, its progress line and the run's summary count those layer calls
    config = load_config(
        "tiny",
        small_run(2, tmp_path, "attention.mode=sparse", "attention.block_size=16", f"attention.dense_below={10**6}"),
    )
    out = io.StringIO()
    trainer = build_trainer(config, tmp_path, Console(file=out, width=200))
    summary = trainer.fit()
    layers = trainer.model.config.num_hidden_layers
    assert summary["attention_layers"] == route_counts({"dense-short-documents": 2 * layers})
    assert f"sparse layers 0/{layers} (dense-short-documents {layers})" in out.getvalue()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["layers"]["dense-short-documents"] for s in steps if "loss" in s] == [layers, layers]


def test_sparse_pattern_changes_the_loss():
    """The converse: a pattern that drops attention gives a different loss (the hook is not dense in disguise)."""
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=1"))
    model = build_model(config, load_tokenizer(config), CPU)
    batch = packed_batch(1)
    router = AttentionRouter(
        AttentionConfig(
            mode="sparse",
            pattern="budget",
            num_vertical=1,
            num_slash=1,
            last_q=16,
            block_size=16,
            local_window=2,
            num_sink=1,
            dense_below=0,
        )
    )
    with torch.no_grad():
        with AttentionRouter():
            dense_logits = model(**batch).logits
        with router:
            sparse_logits = model(**batch).logits
    # same up to the first dropped key, different after
    torch.testing.assert_close(sparse_logits[:, :2], dense_logits[:, :2])
    assert float((sparse_logits - dense_logits).abs().max()) > 1e-2
    assert router.sparse_stats()["sparse_density"] < 1.0


def test_plans_are_reused_by_the_activation_checkpoint_recompute(tmp_path):
    config = load_config(
        "tiny",
        small_run(
            1,
            tmp_path,
            "attention.mode=sparse",
            "attention.block_size=16",
            "attention.dense_below=64",
            "attention.last_q=16",
            "train.activation_checkpointing=true",
        ),
    )
    trainer = build_trainer(config, tmp_path, Console(file=io.StringIO()))
    layers = trainer.model.config.num_hidden_layers
    before = trainer.router.calls()
    metrics = trainer.meter(trainer.train_step())
    after = trainer.router.calls()
    fresh = after.get("sparse-reference", 0) - before.get("sparse-reference", 0)
    reused = after.get("sparse-plan-reused", 0) - before.get("sparse-plan-reused", 0)
    assert reused == layers  # the recompute found every layer's plan
    assert fresh == 2 * layers  # forward and recompute both ran the sparse op
    assert 0.0 < metrics["sparse_recall"] <= 1.0 and 0.0 < metrics["sparse_density"] <= 1.0
    by_layer = metrics["sparse_by_layer"]  # {layer: [recall, density]}, one plan per layer this step
    assert list(by_layer) == [str(i) for i in range(layers)]
    assert sum(r for r, _ in by_layer.values()) / layers == pytest.approx(metrics["sparse_recall"])
    assert sum(d for _, d in by_layer.values()) / layers == pytest.approx(metrics["sparse_density"])
    with trainer.router.micro_batch():
        pass  # the scope is re-entrant and leaves no plans behind
    assert trainer.router.calls() == after


def test_extend_trains_with_sparse_attention(tmp_path):
    overrides = small_run(
        3,
        tmp_path,
        "attention.mode=sparse",
        "attention.block_size=16",
        "attention.last_q=16",
        "attention.dense_below=64",
    )
    result = run_cli("extend", *set_args(overrides))
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["attention_mode"] == "sparse"
    assert summary["attention_calls"].get("sparse-reference", 0) > 0 and "dense" not in summary["attention_calls"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("sparse_recall" in s and "sparse_by_layer" in s for s in steps if "loss" in s)


def test_layers_named_dense_run_dense_and_are_counted():
    """attention.dense_layers: those decoder layers run dense attention (the dense result where every layer is
    named), the others their sparse plans; each counted as its route. The setting reads from YAML as a list and
    is kept as a tuple (the config hashes)."""
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=2", "attention.dense_layers=0"))
    assert config.attention.dense_layers == (0,)
    assert config_from_dict(yaml.safe_load(to_yaml(config))).attention.dense_layers == (0,)  # config.yaml
    model = build_model(config, load_tokenizer(config), CPU)
    batch = packed_batch()
    sparse = dataclasses.replace(FULL, p=0.5, cap=2)  # really sparse: its loss differs from the dense one
    with AttentionRouter():
        dense_loss, dense_grads = loss_and_grads(model, batch)
    losses = {}
    for named in ((), (0,), (0, 1)):
        with AttentionRouter(dataclasses.replace(sparse, dense_layers=named), engine="reference") as router:
            losses[named], grads = loss_and_grads(model, batch)
        layers = router.sparse_stats()["layers"]
        assert (layers["sparse"], layers["dense-layer"]) == (2 - len(named), len(named))
    torch.testing.assert_close(losses[(0, 1)], dense_loss, rtol=0, atol=0)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    assert len({float(loss) for loss in losses.values()}) == 3  # layer 0 dense changes the loss, not to dense's


@pytest.mark.parametrize(
    "override, message",
    [
        ("attention.p=1.5", "attention.p 1.5 must be in (0, 1]"),
        ("attention.block_size=48", "attention.block_size 48 must be 16, 32, 64 or 128"),
        ("attention.mode=flash", "attention.mode 'flash' is not one of dense, sparse"),
        ("attention.dense_layers=[-1]", "attention.dense_layers [-1] must hold decoder layer indices >= 0"),
        ("attention.dense_layers=[0, 99]", "attention.dense_layers [0, 99]: the model has"),
        ("attention.probe_windows=65", "attention.probe_windows 65 must be at most attention.last_q 32"),
        ("attention.probe_windows=0", "attention.probe_windows 0 must be >= 1"),
    ],
)
def test_bad_attention_settings_are_one_line_errors(override, message):
    result = run_cli("extend", "--dry-run", "--set", override)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_mixed_dtypes_reach_the_triton_kernels_in_one_dtype():
    """transformers' rotary step can hand the hook fp32 q/k beside a half-precision v (bf16 autocast on a GPU):
    the hook computes in one dtype, so the kernels never see two (the interpreter rejects mixed dots too)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 96, 16, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 96, 16, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 96, 16, generator=gen).half().requires_grad_()
    doc = torch.zeros(1, 96, dtype=torch.long)
    with AttentionRouter(FULL, engine="triton"):
        out, _ = mtrain_attention(torch.nn.Identity(), q, k, v, None, 0.25, document_ids=doc)
        out.sum().backward()
        want, _ = mtrain_attention(
            torch.nn.Identity(), q.detach(), k.detach(), v.detach().float(), None, 0.25, document_ids=doc
        )
    assert out.dtype == torch.float32 and v.grad.dtype == torch.float16
    torch.testing.assert_close(out, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast: the autocast dtype, as on a GPU
        assert compute_dtype(q) == torch.bfloat16


def test_inference_mode_tensors_go_through_the_plan_caches():
    """Eval runs under torch.inference_mode, whose tensors have no version counter for the per-batch caches."""
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=1"))
    model = build_model(config, load_tokenizer(config), CPU)
    input_ids = packed_batch()["input_ids"]
    with torch.inference_mode():
        with AttentionRouter():
            dense_logits = model(input_ids=input_ids).logits
        with AttentionRouter(FULL, engine="triton") as router:
            before = router.calls().get("sparse-triton", 0)
            sparse_logits = model(input_ids=input_ids).logits
    assert router.calls()["sparse-triton"] == before + 1
    torch.testing.assert_close(sparse_logits, dense_logits, rtol=1e-4, atol=1e-5)


def test_attention_outside_a_router_is_an_error_not_a_default():
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=1"))
    model = build_model(config, load_tokenizer(config), CPU)
    with pytest.raises(RuntimeError, match="outside an attention router"), torch.no_grad():
        model(**packed_batch())


def test_each_router_keeps_its_own_records_and_the_innermost_runs():
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=1"))
    model = build_model(config, load_tokenizer(config), CPU)
    outer, inner = AttentionRouter(), AttentionRouter(FULL)
    with torch.no_grad(), outer:
        model(**packed_batch())
        with inner:
            model(**packed_batch())
        model(**packed_batch())
    assert outer.calls() == {"dense": 2} and inner.calls() == {"sparse-reference": 1}
    assert inner.sparse_stats()["sparse_recall"] > 0 and outer.sparse_stats() == {}

"""`train.compile`: torch.compile each decoder layer, the way torchtitan does.

Why per layer: every decoder layer runs the same code with its own parameters, and dynamo (with
`inline_inbuilt_nn_modules`, the default) treats parameters as graph inputs, so the graphs compiled for the
first layer serve all of them. Compile time is that of one layer whatever the depth, and a layer is also the unit of
activation checkpointing and FSDP sharding. The order is torchtitan's: activation checkpointing, then
compile, then FSDP (`fully_shard` wraps the compiled layer; FSDP2's hooks are dynamo-disabled and run eagerly).

`nn.Module.compile()` compiles each layer in place (no `_orig_mod.` wrapper), so state_dict keys, checkpoints
and the HF export are unchanged.

Attention runs outside the graph: mtrain's registered attention function (`attention.hook.mtrain_attention`) hands
each call to the entered attention router, which keeps Python-side plan caches and call counters, makes host-side
decisions (which path, the sparse plan) and calls Triton autograd functions. transformers looks the function up in
`ALL_ATTENTION_FUNCTIONS` on every call, so we register a `torch.compiler.disable` wrapper of it under the same
name: dynamo graph-breaks at the call and runs the hook eagerly without tracing into it. A layer is then a few
graphs around attention (the break also splits the layer at the attention module's call: norm | q/k/v + rotary |
o_proj | residual + MLP; dynamo's experimental `nested_graph_breaks` would make it two), still one set for all
layers.

Dynamo silently runs a code object uncompiled once it has recompiled it `recompile_limit` times;
`eager_fallbacks()` returns those events so the trainer can warn about them.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers import AttentionInterface

from mtrain_cli.attention import ATTENTION_NAME, mtrain_attention
from mtrain_cli.families import decoder_layers


@functools.cache
def _eager_attention():
    """One wrapper for the process: the compiled graphs guard on the function they looked up, so registering
    the same object again (another Trainer in the same process) does not recompile."""
    return torch.compiler.disable(mtrain_attention)


def should_compile(setting: bool | None, device: torch.device) -> bool:
    """`train.compile`: None (auto) compiles when training on CUDA; on CPU inductor builds C++ and the
    tiny models trained there gain nothing from it."""
    return device.type == "cuda" if setting is None else setting


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of an HF causal LM of a family mtrain extends in place; -> number of layers."""
    layers = decoder_layers(model)
    AttentionInterface.register(ATTENTION_NAME, _eager_attention())
    _watch_recompile_limit()
    for layer in layers:
        layer.compile()
        if getattr(layer, "gradient_checkpointing", False):  # transformers' activation checkpointing is on
            layer._gradient_checkpointing_func = functools.partial(
                _checkpoint_compiled, layer._gradient_checkpointing_func, _compiled_run()
            )
    return len(layers)


def _run(function, *args):
    return function(*args)


@functools.cache
def _compiled_run():
    """Built on first use (importing this module stays cheap), outside any trace: called while dynamo traces,
    `torch.compile(_run)` would give back plain `_run`."""
    return torch.compile(_run)


@torch.compiler.disable
def _checkpoint_compiled(checkpoint, compiled_run, function, *args):
    """checkpoint(compiled(layer forward)) for a layer under activation checkpointing.

    transformers checkpoints a layer's `forward` from inside its `__call__`, so the compiled layer meets
    `torch.utils.checkpoint` while tracing. Dynamo traces a checkpoint as one region or not at all, and it cannot
    trace this one (our eager attention breaks it; from transformers 5.25 the `kernels` package's context variable
    does first, a side effect a checkpoint region refuses), so this function is compiler-disabled and runs
    eagerly. torch's checkpoint disables dynamo inside, so the layer would train uncompiled; an
    explicitly compiled function re-enables it: the forward (and its recompute in backward) runs through
    `compiled_run`, the same graphs as without checkpointing."""
    return checkpoint(compiled_run, function, *args)


def is_compiled(layer: torch.nn.Module) -> bool:
    return getattr(layer, "_compiled_call_impl", None) is not None


# -- silent fallback to eager -----------------------------------------------------------------------------


class _RecompileLimitHandler(logging.Handler):
    """Dynamo logs one warning per code object when it stops compiling it (`torch._dynamo hit config.
    recompile_limit`); keep them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with_args = record.getMessage()
        if "hit config." in with_args:
            self.messages.append(" ".join(line.strip() for line in with_args.splitlines()[:3]))


_handler: _RecompileLimitHandler | None = None


def _watch_recompile_limit() -> None:
    global _handler
    if _handler is None:
        _handler = _RecompileLimitHandler()
        logging.getLogger("torch._dynamo.convert_frame").addHandler(_handler)


def eager_fallbacks() -> list[str]:
    """Dynamo's recompile-limit events since the last call, as warnings for the run summary."""
    if _handler is None or not _handler.messages:
        return []
    events, _handler.messages[:] = list(_handler.messages), []
    limit = torch._dynamo.config.recompile_limit
    return [
        f"train.compile: dynamo stopped compiling a function and runs it eagerly from now on ({event}); "
        f"the layers are slower than compiled. Raise torch._dynamo.config.recompile_limit (now {limit}) or "
        f"set train.compile=false; TORCH_LOGS=recompiles shows why"
        for event in events
    ]

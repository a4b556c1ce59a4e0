"""Parallelism applied to the single-device HF model, in one place and in this order (torchtitan's):

1. activation checkpointing of every decoder layer (`train.activation_checkpointing`);
2. torch.compile of every decoder layer (`train.compile`, train/compile.py), which wraps the checkpointed layer;
3. the loss wrapper (train/loss.py): embedding, decoder, final norm and the chunked LM-head loss in one module,
   the root that FSDP shards;
4. FSDP2 over the flattened dp×cp mesh, each decoder layer and then the root (distributed runs): every rank holds
   a shard of every layer; cp ranks see the same rows, different tokens;
5. the weights of a local model built on the meta device: each rank reads only its own shard
   (train/hf_weights.py).

Context parallelism touches no module: the trainer lays each row's tokens out over the cp ranks once per
micro-batch (parallel/layouts.py), and the attention router runs every layer's attention over the ring
(attention/router.py).

FSDP averages gradients over the ranks; each rank's loss is its token-loss sum divided by the *global* token
count, so the trainer scales it by the world size and the average becomes the sum it needs (a divide factor of 1
would say the same, but needs PREMUL_SUM, which gloo lacks). On GPU, parameters compute in bf16 and reduce in fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mtrain_cli.config import Config
from mtrain_cli.families import decoder_layers
from mtrain_cli.parallel import ParallelContext
from mtrain_cli.train.compile import compile_layers, should_compile
from mtrain_cli.train.hf_weights import load_sharded_weights
from mtrain_cli.train.loss import ChunkedLossModel


def parallelize(model: torch.nn.Module, config: Config, pc: ParallelContext) -> ChunkedLossModel:
    """-> the loss wrapper around `model`, parallelised; `model` is changed in place (checkpointed, compiled,
    sharded, its meta weights loaded)."""
    if config.train.activation_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the name in recent transformers v5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = should_compile(config.train.compile, pc.device)
    if compiled:
        compile_layers(model)
    net = ChunkedLossModel(model, config.train.loss_chunk_size, compiled=compiled)
    if pc.distributed:
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if pc.device.type == "cuda"
            else MixedPrecisionPolicy()
        )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=pc.fsdp_mesh, mp_policy=mp)
        fully_shard(net, mesh=pc.fsdp_mesh, mp_policy=mp)
    if next(model.parameters()).device.type == "meta":
        load_sharded_weights(model, Path(config.model.path).expanduser(), pc.device)
    return net

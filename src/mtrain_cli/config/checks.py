"""Checks of a config (each section's own, then the rules across sections) and of a launch: each failure one line
naming the field, the value and the fix."""

from __future__ import annotations

from mtrain_cli.config.tree import Config, ParallelConfig
from mtrain_cli.errors import UserError
from mtrain_cli.parallel.sizes import layout_unit, splits_into_nodes


def validate(config: Config) -> None:
    """Each section's own fields (its `check`), then the rules across sections; each failure is one line with the
    field, the value and the fix."""
    m, d, p = config.model, config.data, config.parallel
    for section in (m, config.context, d, config.train, config.checkpoint, config.logging, p):
        section.check()
    _check_run_name(config.run.name)
    beyond = [layer for layer in config.attention.dense_layers if layer >= m.num_hidden_layers]
    if beyond:
        raise UserError(
            f"attention.dense_layers {list(config.attention.dense_layers)}: the model has {m.num_hidden_layers} "
            f"decoder layers (0-{m.num_hidden_layers - 1}); drop {beyond}"
        )
    if m.path is None and d.seq_len > config.extended_context():
        raise UserError(
            f"data.seq_len {d.seq_len} exceeds the extended context {config.extended_context()} "
            f"(context.factor × original); raise context.factor or lower data.seq_len"
        )
    if config.train.lora is not None and config.train.lora.export == "adapter" and m.path is None:
        raise UserError(
            "train.lora.export adapter needs a base model directory (--model): a fresh model has no base to load "
            "the adapter onto; set train.lora.export=merged"
        )
    if p.hierarchical and p.node_size is not None:
        check_launch(p, p.dp * p.cp, p.node_size)
    if p.cp > 1:
        unit = layout_unit(p.layout, p.cp, config.attention.block_size)
        if d.seq_len % unit:
            raise UserError(
                f"data.seq_len {d.seq_len} must be divisible by "
                f"{'2×' if p.layout == 'zigzag' else ''}cp×block = {unit} for the {p.layout} layout; "
                f"use data.seq_len={-(-d.seq_len // unit) * unit}"
            )


def check_launch(p: ParallelConfig, world: int, node_size: int, nproc_flag: bool = False) -> None:
    """The mesh against the launch, in one place: dp × cp processes, and a hierarchical ring's nodes of
    `node_size` ranks (parallel.node_size, else the launcher's ranks per node). nproc_flag: checked by
    `--nproc N` before it launches (world = N), so that it is said once rather than by every rank."""
    if p.dp * p.cp != world:
        if nproc_flag:
            raise UserError(
                f"--nproc {world}: parallel.dp {p.dp} × parallel.cp {p.cp} = {p.dp * p.cp}; set "
                f"parallel.dp={max(1, world // p.cp)} (and parallel.cp) so that dp × cp = {world}"
            )
        hint = (
            f"launch {p.dp * p.cp} processes (mtrain extend --nproc {p.dp * p.cp}, or torchrun --nproc-per-node "
            f"{p.dp * p.cp})"
            if world == 1
            else f"set parallel.dp={max(1, world // p.cp)}"
        )
        raise UserError(
            f"parallel.dp {p.dp} × parallel.cp {p.cp} = {p.dp * p.cp} does not match the {world} "
            f"launched process(es); {hint}"
        )
    if p.hierarchical and not splits_into_nodes(p.cp, node_size):
        field = f"parallel.node_size {node_size}" if p.node_size is not None else f"the node size {node_size}"
        raise UserError(f"{field} must divide parallel.cp {p.cp} into 2 or more nodes; set parallel.node_size")


def _check_run_name(name: str) -> None:
    """run.name prefixes the run directory made inside run.output_dir: a path would write elsewhere."""
    if name and name not in (".", "..") and not any(c in name for c in "/\\\0"):
        return
    safe = "-".join(part for part in name.replace("\\", "/").split("/") if part.strip(".")) or "run"
    raise UserError(
        f"run.name {name!r} must be a name, not a path (no '/' and not '..': the run directory is made inside "
        f"run.output_dir); set run.name={safe} and choose the directory with --output-dir"
    )

"""Cross-field checks of a config and of a launch: each failure one line naming the field, the value and the
fix."""

from __future__ import annotations

from mtrain_cli.config.tree import Config, ParallelConfig
from mtrain_cli.errors import UserError


def validate(config: Config) -> None:
    """Cross-field checks; each failure is one line with the field, the value and the fix."""
    m, c, d, t, ck, p = config.model, config.context, config.data, config.train, config.checkpoint, config.parallel
    _positive(
        config,
        [
            "model.hidden_size",
            "model.intermediate_size",
            "model.num_hidden_layers",
            "model.num_attention_heads",
            "model.num_key_value_heads",
            "model.max_position_embeddings",
            "data.seq_len",
            "data.num_proc",
            "train.num_steps",
            "train.batch_size",
            "train.grad_accum",
            "train.lr",
            "train.loss_chunk_size",
            "train.eval_every",
            "checkpoint.every",
            "checkpoint.keep_last",
            "logging.every",
            "parallel.cp",
            "parallel.dp",
        ],
    )
    _check_run_name(config.run.name)
    beyond = [layer for layer in config.attention.dense_layers if layer >= m.num_hidden_layers]
    if beyond:
        raise UserError(
            f"attention.dense_layers {list(config.attention.dense_layers)}: the model has {m.num_hidden_layers} "
            f"decoder layers (0-{m.num_hidden_layers - 1}); drop {beyond}"
        )
    if m.path is None:
        if m.head_dim is not None and (m.head_dim <= 0 or m.head_dim % 2):
            raise UserError(f"model.head_dim {m.head_dim} must be a positive even number (RoPE rotates pairs)")
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            raise UserError(
                f"model.hidden_size {m.hidden_size} must be divisible by model.num_attention_heads "
                f"{m.num_attention_heads}"
            )
        if m.num_attention_heads % m.num_key_value_heads:
            raise UserError(
                f"model.num_attention_heads {m.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads {m.num_key_value_heads}"
            )
    if c.method != "none" and c.factor <= 1.0:
        raise UserError(f"context.factor {c.factor} must be > 1 to extend the context (or set context.method=none)")
    if c.method == "theta" and c.rope_theta is None:
        raise UserError("context.rope_theta is required when context.method=theta, e.g. --set context.rope_theta=1e6")
    if c.beta_fast is not None and c.beta_slow is not None and c.beta_fast <= c.beta_slow:
        raise UserError(f"context.beta_fast {c.beta_fast} must be greater than context.beta_slow {c.beta_slow}")
    if m.path is None and d.seq_len > config.extended_context():
        raise UserError(
            f"data.seq_len {d.seq_len} exceeds the extended context {config.extended_context()} "
            f"(context.factor × original); raise context.factor or lower data.seq_len"
        )
    if not d.sources:
        raise UserError(
            "data.sources is empty; pass your long documents with --data PATH (a local .jsonl/.parquet/.txt "
            "file or dataset directory; repeatable), or list them in the recipe"
        )
    if not 0.0 <= d.short_fraction < 1.0:
        raise UserError(f"data.short_fraction {d.short_fraction} must be in [0, 1)")
    if d.short_fraction > 0 and not d.short_sources:
        raise UserError(f"data.short_fraction {d.short_fraction} needs data.short_sources (local short documents)")
    if d.num_val_rows < 0:
        raise UserError(f"data.num_val_rows {d.num_val_rows} must be >= 0")
    if not 0 <= t.warmup_steps <= t.num_steps:
        raise UserError(
            f"train.warmup_steps {t.warmup_steps} must be in [0, train.num_steps={t.num_steps}] (warm-up is part "
            f"of the run); set it too, e.g. --set train.warmup_steps={min(max(t.warmup_steps, 0), t.num_steps // 10)}"
        )
    for name, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= value < 1.0:
            raise UserError(f"{name} {value} must be in [0, 1) (AdamW's moment decay; the defaults are 0.9, 0.95)")
    if t.weight_decay < 0:
        raise UserError(f"train.weight_decay {t.weight_decay} must be >= 0 (0 turns decay off)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise UserError(f"train.min_lr_ratio {t.min_lr_ratio} must be in [0, 1]")
    if t.grad_clip < 0:
        raise UserError(f"train.grad_clip {t.grad_clip} must be >= 0 (0 disables clipping)")
    if ck.keep_last < 1:
        raise UserError(f"checkpoint.keep_last {ck.keep_last} must be >= 1")
    if t.lora is not None:
        _validate_lora(config)
    _validate_parallel(p, d.seq_len, config.attention.block_size)


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
    if p.hierarchical and (p.cp % node_size or node_size >= p.cp):
        field = f"parallel.node_size {node_size}" if p.node_size is not None else f"the node size {node_size}"
        raise UserError(f"{field} must divide parallel.cp {p.cp} into 2 or more nodes; set parallel.node_size")


def _validate_parallel(p: ParallelConfig, seq_len: int, block: int) -> None:
    if p.node_size is not None and p.node_size < 1:
        raise UserError(f"parallel.node_size {p.node_size} must be >= 1")
    if p.hierarchical:
        if p.cp == 1:
            raise UserError("parallel.hierarchical needs parallel.cp > 1 (a ring to split into nodes)")
        if p.node_size is not None:
            check_launch(p, p.dp * p.cp, p.node_size)
    elif p.node_size is not None:
        raise UserError(f"parallel.node_size {p.node_size} is only used with parallel.hierarchical=true")
    if p.cp > 1:
        unit = p.cp * block * (2 if p.layout == "zigzag" else 1)
        if seq_len % unit:
            raise UserError(
                f"data.seq_len {seq_len} must be divisible by "
                f"{'2×' if p.layout == 'zigzag' else ''}cp×block = {unit} for the {p.layout} layout; "
                f"use data.seq_len={-(-seq_len // unit) * unit}"
            )


def _validate_lora(config: Config) -> None:
    lora = config.train.lora
    if lora.rank < 1:
        raise UserError(f"train.lora.rank {lora.rank} must be >= 1 (8-64 are usual)")
    if lora.alpha <= 0:
        raise UserError(f"train.lora.alpha {lora.alpha} must be > 0 (the update is scaled by alpha / rank)")
    if not 0.0 <= lora.dropout < 1.0:
        raise UserError(f"train.lora.dropout {lora.dropout} must be in [0, 1)")
    if not lora.target_modules:
        raise UserError("train.lora.target_modules is empty; name the linear layers to adapt, e.g. [q_proj, v_proj]")
    if lora.export == "adapter":
        if config.model.path is None:
            raise UserError(
                "train.lora.export adapter needs a base model directory (--model): a fresh model has no base to load "
                "the adapter onto; set train.lora.export=merged"
            )
        if lora.train_embeddings_norms:
            raise UserError(
                "train.lora.export adapter: the adapter files cannot carry the embeddings and norms that "
                "train.lora.train_embeddings_norms trains; set train.lora.export=merged"
            )


def _positive(config: Config, names: list[str]) -> None:
    for name in names:
        section, key = name.split(".")
        value = getattr(getattr(config, section), key)
        if value <= 0:
            raise UserError(f"{name} {value} must be > 0")


def _check_run_name(name: str) -> None:
    """run.name prefixes the run directory made inside run.output_dir: a path would write elsewhere."""
    if name and name not in (".", "..") and not any(c in name for c in "/\\\0"):
        return
    safe = "-".join(part for part in name.replace("\\", "/").split("/") if part.strip(".")) or "run"
    raise UserError(
        f"run.name {name!r} must be a name, not a path (no '/' and not '..': the run directory is made inside "
        f"run.output_dir); set run.name={safe} and choose the directory with --output-dir"
    )

"""`mtrain profile`: throughput of the sparse kernels, the dense/sparse crossover, the ring and training steps.

Thin commands like the rest of the CLI (cli/main.py): options are checked here, the work is in mtrain_cli.profile."""

from __future__ import annotations

from pathlib import Path

import typer

from mtrain_cli.cli.launch import leave_launched_rank
from mtrain_cli.cli.usage import Command, Group, output_console, require_command
from mtrain_cli.errors import UserError
from mtrain_cli.lazy import import_long_lived

console = output_console()

profile_app = typer.Typer(cls=Group, help="Throughput of the attention kernels, the ring and training steps.")


@profile_app.callback(invoke_without_command=True)
def _profile_options(ctx: typer.Context) -> None:
    require_command(ctx)


@profile_app.command(
    "kernels", cls=Command, epilog="Example:\n\n  mtrain profile kernels --lengths 32k,128k --out bench/results/k.json"
)
def profile_kernels_command(
    lengths: str = typer.Option("32k,64k,128k,256k", "--lengths", help="Sequence lengths (k = 1024)."),
    patterns: str = typer.Option("planted,random", "--patterns", help="planted (estimated) and/or random."),
    flex_lengths: str = typer.Option("32k,128k", "--flex-lengths", help="Lengths that also run FlexAttention."),
    repeats: int = typer.Option(10, "--repeats", help="Timed repetitions (median reported)."),
    block_sizes: str = typer.Option("64", "--block-sizes", help="Layout blocks to compare, e.g. 64,128."),
    planted_slashes: str = typer.Option(
        "16,8,4",
        "--planted-slashes",
        help="Far slashes planted per KV head, one planted case each, e.g. 16,8 "
        "(fewer leave more diffuse mass: a denser estimated pattern; at 128K "
        "16, 8 and 4 give about 8%, 13% and 19%).",
    ),
    out: Path | None = typer.Option(None, "--out", help="Write JSON here (and a .md table beside it)."),
) -> None:
    """Sparse forward/backward vs dense SDPA (cuDNN, flash) and FlexAttention on the same pattern."""
    from mtrain_cli.lengths import parse_lengths

    names = [p.strip() for p in patterns.split(",") if p.strip()]
    if not names or set(names) - {"planted", "random"}:
        raise UserError(f"--patterns {patterns!r} must be planted, random or both")
    blocks = [b.strip() for b in block_sizes.split(",") if b.strip()]
    if not blocks or any(b not in ("64", "128") for b in blocks):
        raise UserError(f"--block-sizes {block_sizes!r} must list 64 and/or 128 (GPU kernel tiles), e.g. 64,128")
    slashes = [s.strip() for s in planted_slashes.split(",") if s.strip()]
    if not slashes or not all(s.isdigit() and int(s) > 0 for s in slashes):
        raise UserError(f"--planted-slashes {planted_slashes!r} must list positive integers, e.g. 16,8")
    parsed_lengths, parsed_flex = parse_lengths(lengths, "--lengths"), parse_lengths(flex_lengths, "--flex-lengths")
    import torch  # after the arguments: a typo is answered at once, on any machine

    from mtrain_cli.profile import KernelProfileSpec, kernel_profile_table, run_kernel_profile, write_report

    spec = KernelProfileSpec(
        lengths=parsed_lengths,
        patterns=names,
        repeats=repeats,
        flex_lengths=tuple(parsed_flex),
        block_sizes=tuple(int(b) for b in blocks),
        planted_slashes=tuple(int(s) for s in slashes),
    )
    if not torch.cuda.is_available():  # after the arguments: a typo is reported on any machine
        raise UserError("mtrain profile kernels needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)")

    def save(result) -> None:
        write_report(out, result, kernel_profile_table(result))

    result = run_kernel_profile(spec, log=lambda line: console.print(line, highlight=False), save=save)
    save(result)
    console.print(kernel_profile_table(result), highlight=False, markup=False)


@profile_app.command(
    "crossover", cls=Command, epilog="Example:\n\n  mtrain profile crossover --out bench/results/crossover_h100.json"
)
def profile_crossover_command(
    lengths: str = typer.Option("8k,16k,32k,64k,128k", "--lengths", help="Sequence lengths (k = 1024)."),
    head_dims: str = typer.Option("64,128", "--head-dims", help="Head dims: 64 (14/2 heads) and/or 128 (16/2)."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions (median reported)."),
    out: Path | None = typer.Option(None, "--out", help="Write JSON here (and a .md table beside it)."),
) -> None:
    """The work share above which dense attention beats sparse (plan + kernels), per length and head dim."""
    from mtrain_cli.lengths import parse_lengths

    parsed_lengths = parse_lengths(lengths, "--lengths")
    if repeats < 1:
        raise UserError(f"--repeats {repeats} must be >= 1")
    from mtrain_cli.attention import MEASURED_HEADS  # torch-free

    dims = [d.strip() for d in head_dims.split(",") if d.strip()]
    if not dims or any(not d.isdigit() or int(d) not in MEASURED_HEADS for d in dims):
        raise UserError(f"--head-dims {head_dims!r} must list {' and/or '.join(map(str, MEASURED_HEADS))}, e.g. 64,128")
    import torch  # after the arguments above

    from mtrain_cli.profile import CrossoverSpec, crossover_table, run_crossover_profile, write_report

    spec = CrossoverSpec(lengths=parsed_lengths, head_dims=tuple(int(d) for d in dims), repeats=repeats)
    if not torch.cuda.is_available():  # after the arguments: a typo is reported on any machine
        raise UserError(
            "mtrain profile crossover needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)"
        )
    result = run_crossover_profile(
        spec,
        log=lambda line: console.print(line, highlight=False),
        save=lambda partial: write_report(out, partial, crossover_table(partial)),
    )
    write_report(out, result, crossover_table(result))
    console.print(crossover_table(result), highlight=False, markup=False)


@profile_app.command(
    "ring",
    cls=Command,
    epilog="Example (8 GPUs):\n\n  torchrun --nproc-per-node 8 -m mtrain_cli profile ring "
    "--seq-len 512k --node-size 4 --out bench/results/ring.json",
)
def profile_ring_command(
    seq_len: str = typer.Option("128k", "--seq-len", help="Global sequence length (k = 1024)."),
    modes: str = typer.Option(
        "sparse-stripe,sparse-zigzag,sparse-hierarchical,dense-zigzag,torch-cp-cudnn,torch-cp-flash",
        "--modes",
        help="Comma-separated modes (torch-cp-* need GPUs).",
    ),
    node_size: int | None = typer.Option(
        None, "--node-size", help="Ranks per declared node (sparse-hierarchical); default: LOCAL_WORLD_SIZE."
    ),
    heads: int = typer.Option(16, "--heads", help="Query heads of the attention layer profiled."),
    kv_heads: int = typer.Option(2, "--kv-heads", help="Key/value heads (grouped-query attention)."),
    head_dim: int = typer.Option(128, "--head-dim", help="Dimension of each head."),
    block_size: int = typer.Option(
        64,
        "--block-size",
        help="Sparse layout block, in tokens (64 on GPU); --seq-len must be divisible by 2 × ranks × block.",
    ),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions (median reported)."),
    out: Path | None = typer.Option(None, "--out", help="Write JSON here (and a .md table beside it)."),
) -> None:
    """Sparse and dense ring attention across the ranks of a torchrun launch (NCCL on GPU, gloo on CPU)."""
    from mtrain_cli.lengths import parse_lengths

    (length,) = parse_lengths(seq_len, "--seq-len")
    names = [m.strip() for m in modes.split(",") if m.strip()]
    import_long_lived("mtrain_cli.profile.ring")
    from mtrain_cli.profile import profile_ring_main

    profile_ring_main(
        length,
        names,
        node_size,
        heads,
        kv_heads,
        head_dim,
        block_size,
        repeats,
        out,
        log=lambda line: console.print(line, highlight=False, markup=False),
    )


@profile_app.command(
    "step",
    cls=Command,
    epilog="Examples:\n\n  mtrain profile step --recipe tiny --steps 2\n\n"
    "  torchrun --nproc-per-node 8 -m mtrain_cli profile step --recipe qwen2.5-3b-512k "
    "--out bench/results/step.json",
)
def profile_step_command(
    recipe: str | None = typer.Option(None, "--recipe", "-r", help="Recipe name or YAML path."),
    overrides: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Dotted override (repeatable)."),
    model: Path | None = typer.Option(None, "--model", help="Local Hugging Face model directory."),
    data: list[str] = typer.Option([], "--data", metavar="PATH", help="Local dataset path; repeatable."),
    warmup: int = typer.Option(
        1,
        "--warmup",
        help="Steps run before profiling, at least --steps: the last --steps of them read the batches then "
        "profiled, so Triton kernels and sparse plans are built before the profile.",
    ),
    steps: int = typer.Option(2, "--steps", help="Profiled steps (times are per step)."),
    out: Path | None = typer.Option(None, "--out", help="Write JSON here (and a .md table beside it)."),
    trace_dir: Path | None = typer.Option(
        None, "--trace-dir", help="Keep each rank's profiler trace here as rank<N>.json (chrome://tracing, Perfetto)."
    ),
) -> None:
    """Where a training step's time goes: attention, sparse plans, matmuls, communication, optimizer (profiler)."""
    import os

    from mtrain_cli.config import default_recipe, load_config

    if warmup < 0 or steps < 1:
        raise UserError(f"--warmup {warmup} / --steps {steps}: need warmup >= 0 and steps >= 1")
    extra = [f"model.path={model}"] if model else []
    extra += [f"data.sources=[{', '.join(repr(d) for d in data)}]"] if data else []
    config = load_config(recipe if recipe is not None else default_recipe(model, data), [*extra, *overrides])
    if trace_dir is not None:
        trace_dir = trace_dir.resolve()
        try:
            trace_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(
                f"--trace-dir {trace_dir}: cannot make it a directory ({exc.strerror}); name another"
            ) from None
    import_long_lived("mtrain_cli.profile.step")  # torch: after the config is checked
    from mtrain_cli.profile import profile_step, step_table, write_report

    result = profile_step(config, warmup, steps, console, trace_dir)
    if os.environ.get("RANK", "0") == "0":
        table = step_table(result)
        console.print(table, highlight=False, markup=False)
        write_report(out, result, table)
    leave_launched_rank()

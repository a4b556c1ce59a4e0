"""`mtrain demo`, what `make demo` runs: what context extension buys, in about two minutes on 2 CPU cores.

1. extend the shipped base model (data/tiny-base: a tiny Qwen2 pretrained at 256 tokens by recipes/tiny-base.yaml)
   8x with YaRN to 2,048 tokens: `mtrain extend --recipe tiny --model data/tiny-base`;
2. the passkey test at 256, 512, 1K and 2K tokens on the base as pretrained (`mtrain eval data/tiny-base ...`), on the
   base with that YaRN applied and no training (`... --yarn 8`) and on the extended model (`mtrain eval RUN ...`);
3. the three side by side.

Each step is the ordinary command named above, run in this one process (torch is imported once)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mtrain_cli.eval import length_label

BASE_MODEL = "data/tiny-base"
RECIPE = "tiny"
SUITE, TASK = "infinitebench", "passkey"
LENGTHS = "256,512,1k,2k"
SAMPLES = 20  # per length; the needle's depth steps from 0% to 100% over them
SEED = 0  # eval's samples (its default): none of them is a training document (tests/test_demo.py)


@dataclass
class DemoResult:
    """The extension's run directory and the eval run directory of each model."""

    extend_run: Path
    base: Path  # the base as pretrained
    base_yarn: Path  # the base with the recipe's YaRN, no training
    extended: Path


def run_demo(
    console: Console, output_dir: Path, overrides: tuple[str, ...] = (), lengths: str = LENGTHS, samples: int = SAMPLES
) -> DemoResult:
    """Extend, evaluate the three models, print the before/after table. `overrides`: --set items on the recipe."""
    from mtrain_cli.config import load_config
    from mtrain_cli.eval import parse_options, run_eval
    from mtrain_cli.resources import shipped_path
    from mtrain_cli.train import run_extend

    base = shipped_path(BASE_MODEL)
    assert base is not None, f"the package was installed without {BASE_MODEL}"
    config = load_config(RECIPE, [f"model.path={base}", f"run.output_dir={output_dir}", *overrides])
    console.rule(
        f"1/4 extend {BASE_MODEL} {config.model.max_position_embeddings} -> {config.extended_context()} "
        f"tokens with YaRN: mtrain extend --recipe {RECIPE} --model {BASE_MODEL}"
    )
    extended = run_extend(config, None, console)

    def evaluate(model: Path, yarn: float | None) -> Path:
        options = parse_options(
            model_dir=model, suite=SUITE, lengths=lengths, samples=samples, seed=SEED, out=Path(output_dir), tasks=TASK,
            yarn=yarn,
        )  # fmt: skip
        return run_eval(options, console)

    factor = config.context.factor
    console.rule(f"2/4 the base as pretrained: mtrain eval {BASE_MODEL} --suite {SUITE} --tasks {TASK}")
    plain = evaluate(base, None)
    console.rule(f"3/4 the base with YaRN x{factor:g} and no training: mtrain eval {BASE_MODEL} --yarn {factor:g} ...")
    untrained = evaluate(base, factor)
    console.rule(f"4/4 the extended model: mtrain eval {extended.run_dir} --suite {SUITE} --tasks {TASK}")
    trained = evaluate(extended.run_dir, None)
    console.print(
        before_after_table(
            [
                (f"base, RoPE as pretrained ({config.model.max_position_embeddings} tokens)", plain),
                (f"base + YaRN x{factor:g}, no training", untrained),
                (
                    f"extended: YaRN x{factor:g} + {config.train.num_steps} steps at {config.data.seq_len:,} tokens",
                    trained,
                ),
            ],
            SUITE,
            TASK,
        )
    )
    return DemoResult(extended.run_dir, plain, untrained, trained)


def before_after_table(runs: list[tuple[str, Path]], suite: str, task: str) -> Table:
    """One row per (label, eval run directory): `task`'s score at each length, read from results.json."""
    results = [(label, json.loads((run_dir / "results.json").read_text())) for label, run_dir in runs]
    lengths = results[0][1]["lengths"]
    samples = results[0][1]["samples"]
    table = Table(title=f"{task} retrieval, % of {samples} samples per length (needle depth 0-100%)")
    table.add_column("model")
    for length in lengths:
        table.add_column(length_label(length), justify="right")
    for label, result in results:
        cells = result["suites"][suite]["rows"].get(task, {})
        table.add_row(label, *(f"{cells[str(length)]:.0f}" if str(length) in cells else "-" for length in lengths))
    return table

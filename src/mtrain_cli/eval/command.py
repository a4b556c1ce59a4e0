"""`mtrain eval` end to end: parse options (options.py, checked against the suites in registry.py) → read every selected
suite's local files (bad input stops the run before the model loads) → load model and tokenizer → per suite:
prepare samples, run them, score → write the run directory (results.json, predictions.jsonl, summary.md, CSVs,
PNGs) and print the tables.

Options and data files are checked before torch, transformers and matplotlib are imported (inside the
functions that need them), so a typo is answered in a fraction of a second."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

import mtrain_cli
from mtrain_cli.errors import UserError
from mtrain_cli.eval.haystack import HAYSTACK_DIR
from mtrain_cli.eval.options import EvalOptions
from mtrain_cli.eval.prompts import PromptFormat
from mtrain_cli.eval.registry import SUITES, command_line, parse_options
from mtrain_cli.eval.results import Outcome, SuiteResult, make_run_dir, write_results
from mtrain_cli.eval.suite import SuiteRun
from mtrain_cli.lazy import import_long_lived

if TYPE_CHECKING:  # these import torch, transformers or matplotlib: loaded once the options are checked
    from mtrain_cli.eval.loading import LoadedModel
    from mtrain_cli.eval.sparse import SparseTracker


def _beyond_context(options: EvalOptions, loaded: LoadedModel) -> str | None:
    """The caveat for lengths past the model's max_position_embeddings: warned at the start, kept in the notes."""
    max_positions = getattr(loaded.model.config, "max_position_embeddings", None)
    beyond = [length for length in options.lengths if max_positions and length > max_positions]
    if not beyond:
        return None
    return (
        f"lengths {', '.join(map(str, beyond))} exceed the model's max_position_embeddings "
        f"({max_positions}): scores there measure extrapolation"
    )


FAR_BEYOND_CONTEXT = 8  # × max_position_embeddings: YaRN's usual factor, and what the demo's untrained base runs


def check_lengths(options: EvalOptions, loaded: LoadedModel, memory_bytes: int) -> None:
    """Lengths far past what the model or the device can hold are refused before any prompt is built (a 10M-token
    prompt takes minutes to build, then its prefill fails or runs for hours), unless --force-lengths: more than
    FAR_BEYOND_CONTEXT × the model's context, or one batch's KV caches larger than the device's `memory_bytes`."""
    if options.force_lengths:
        return
    config, longest = loaded.model.config, max(options.lengths)
    max_positions = getattr(config, "max_position_embeddings", None)
    fix = "give shorter --lengths, or pass --force-lengths to run them anyway"
    if max_positions and longest > FAR_BEYOND_CONTEXT * max_positions:
        raise UserError(
            f"--lengths {longest:,}: {longest / max_positions:,.0f}x the model's context (max_position_embeddings "
            f"{max_positions:,}; beyond {FAR_BEYOND_CONTEXT}x, {FAR_BEYOND_CONTEXT * max_positions:,} tokens, "
            f"scores measure nothing but the prefill's cost); {fix}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cache = 2 * config.num_hidden_layers * kv_heads * head_dim * loaded.dtype.itemsize * longest * options.batch_size
    if cache > memory_bytes:
        raise UserError(
            f"--lengths {longest:,}: the KV caches of a batch of {options.batch_size} take {cache / 2**30:,.1f} GiB, "
            f"more than the {memory_bytes / 2**30:,.1f} GiB of {loaded.device}; {fix}"
        )


def device_memory(device) -> int:
    """Bytes of memory on `device`: the GPU's, or the machine's RAM."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _notes(options: EvalOptions, loaded: LoadedModel, sparse: dict[str, Any] | None) -> list[str]:
    """Caveats a reader of the results must see next to the numbers."""
    notes = []
    beyond = _beyond_context(options, loaded)
    if beyond:
        notes.append(beyond)
    if options.haystack_dir is None and any(HAYSTACK_DIR in SUITES[suite].options for suite in options.suites):
        notes.append(
            "no --haystack-dir: RULER's essay-haystack tasks and NIAH use the synthetic noise haystack "
            "(labelled in each task's source), so they are not comparable to published essay numbers"
        )
    if sparse is not None and sparse["prefills_probed"] < sparse["prefills"]:
        notes.append(
            f"{sparse['prefills'] - sparse['prefills_probed']} of {sparse['prefills']} prompts were shorter "
            f"than the sparse setting dense_below ({sparse['settings']['dense_below']} tokens): the sparse "
            f"path attended densely to them (no pattern estimated)"
        )
    return notes


def yarn_note(factor: float, loaded: LoadedModel) -> str:
    """How --yarn changed the model: 'YaRN ×8 applied at load, no training: context 256 -> 2,048'."""
    original = loaded.model.config.rope_parameters["original_max_position_embeddings"]
    return (
        f"YaRN ×{factor:g} applied at load, no training: context {original:,} -> "
        f"{loaded.model.config.max_position_embeddings:,}"
    )


def _versions() -> dict[str, str]:
    versions = {"mtrain": mtrain_cli.__version__}
    for package in ("torch", "transformers", "tokenizers"):
        versions[package] = importlib.metadata.version(package)
    return versions


def run_eval(options: EvalOptions, console: Console) -> Path:
    """Runs the selected suites; -> the run directory. Local inputs are read before torch loads."""
    started = time.perf_counter()
    inputs = {name: SUITES[name].read(options) for name in options.suites}
    if not options.model_dir.exists():  # what it is, load_model tells once torch is loaded
        raise UserError(
            f"MODEL {options.model_dir} does not exist; pass a local Hugging Face model directory (config.json, "
            f"*.safetensors, tokenizer.json), an mtrain run directory or one of its checkpoints"
        )
    from mtrain_cli.eval.sparse import attention_routing

    import_long_lived("mtrain_cli.eval.loading", "mtrain_cli.eval.runner")
    with attention_routing(options.sparse) as tracker, _stop_signals_as_ctrl_c() as stopped_by:
        return _run_suites(options, inputs, console, tracker, started, stopped_by)


@contextmanager
def _stop_signals_as_ctrl_c() -> Iterator[list[int]]:
    """SIGTERM (a scheduler, `kill`, `timeout`) stops the run as Ctrl-C does: what finished is kept, marked
    partial. A job started in the background by a script ignores SIGINT (the shell sets SIG_IGN): SIGTERM still
    stops it. Yields the signals received, the first deciding the exit code (128 + its number)."""
    received: list[int] = []

    def stop(signum: int, _frame) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_suites(
    options: EvalOptions,
    inputs: dict[str, Any],
    console: Console,
    tracker: SparseTracker | None,
    started: float,
    stopped_by: list[int],
) -> Path:
    """tracker: None for dense attention (SDPA), else what the router's sparse path did in this run."""
    from mtrain_cli.attention import ATTENTION_NAME
    from mtrain_cli.eval.loading import load_model
    from mtrain_cli.eval.runner import Runner, check_batch_size

    loaded = load_model(
        options.model_dir, attn_implementation="sdpa" if tracker is None else ATTENTION_NAME, yarn=options.yarn
    )
    check_batch_size(loaded.model, options.batch_size)
    check_lengths(options, loaded, device_memory(loaded.device))
    fmt = PromptFormat(loaded.tokenizer, options.chat_template)
    run_dir = make_run_dir(options.out, loaded.name)
    run = SuiteRun(options, loaded, Runner(loaded.model, loaded.tokenizer, sparse=tracker), fmt, run_dir, console)
    attention = options.attention if options.sparse is None else f"sparse ({options.sparse.source})"
    yarn = f"; {yarn_note(options.yarn, loaded)}" if options.yarn is not None else ""
    tasks = f" (tasks {','.join(options.tasks)})" if options.tasks is not None else ""
    console.print(
        f"mtrain eval: {loaded.name} ({loaded.source}) on {loaded.device}, {loaded.dtype}, {attention} "
        f"attention{yarn}; suites {','.join(options.suites)}{tasks}; lengths {options.lengths}; "
        f"{options.samples} samples, batches of {options.batch_size}; -> {run_dir}"
    )
    beyond = _beyond_context(options, loaded)
    if beyond:  # once, before any sample runs; results.json keeps it in its notes
        console.print(f"[yellow]warning:[/] {beyond}", highlight=False)
    suites: list[SuiteResult] = []
    outcomes: list[Outcome] = []
    interrupted = None  # the suite Ctrl-C stopped
    for name in options.suites:
        try:
            result, suite_outcomes = SUITES[name].run(run, inputs[name])
        except KeyboardInterrupt:  # while its prompts were built: nothing of it ran
            interrupted = name
            break
        suites.append(result)
        outcomes += suite_outcomes
        if run.runner.interrupted:
            interrupted = name
            break
    signum = stopped_by[0] if stopped_by else signal.SIGINT
    if interrupted is not None and not any(cells for suite in suites for cells in suite.rows.values()):
        shutil.rmtree(run_dir, ignore_errors=True)  # made by this command, and nothing had finished
        raise EvalInterrupted(
            f"interrupted ({_signal_name(signum)}) in {interrupted} before any result; removed {run_dir}", signum
        )
    sparse = tracker.report() if tracker is not None else None
    partial = _partial(options, interrupted, suites, signum, run.runner.partial_cells) if interrupted else None
    header: dict[str, Any] = {
        "model": {
            "name": loaded.name,
            "path": str(loaded.path.resolve()),
            "source": loaded.source,
            "max_position_embeddings": getattr(loaded.model.config, "max_position_embeddings", None),
            "rope_parameters": getattr(loaded.model.config, "rope_parameters", None),
        },
        "yarn": None if options.yarn is None else {"factor": options.yarn, "note": yarn_note(options.yarn, loaded)},
        "suites_requested": options.suites,
        "tasks": options.tasks,
        "lengths": options.lengths,
        "samples": options.samples,
        "batch_size": options.batch_size,
        "seed": options.seed,
        "attention": options.attention,
        "sparse": sparse,
        "chat_template": options.chat_template,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "wall_time_s": round(time.perf_counter() - started, 3),
        "partial": partial,
        "notes": _notes(options, loaded, sparse) + ([partial] if partial else []),
        "command": command_line(options),
        "versions": _versions(),
    }
    write_results(run_dir, header, suites, outcomes, console)
    if interrupted is not None:
        raise EvalInterrupted(
            f"interrupted ({_signal_name(signum)}): the results that finished are in {run_dir}, marked partial", signum
        )
    if not any(cells for suite in suites for cells in suite.rows.values()):
        raise UserError(
            f"nothing was measured: every task was skipped at lengths {', '.join(map(str, options.lengths))} "
            f"(the reasons are above and in {run_dir / 'summary.md'}); give longer --lengths or the missing data"
        )
    return run_dir


class EvalInterrupted(Exception):
    """Ctrl-C or SIGTERM stopped `mtrain eval`: what finished is written (results.json marks it partial), or
    nothing was. exit_code: 128 + the signal's number."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + signum


def _signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _partial(
    options: EvalOptions, interrupted: str, suites: list[SuiteResult], signum: int, partial_cells: list[str]
) -> str:
    done = [suite.name for suite in suites if suite.name != interrupted]
    not_run = options.suites[options.suites.index(interrupted) + 1 :]
    cut = f"; cells with fewer samples than asked: {'; '.join(partial_cells)}" if partial_cells else ""
    return (
        f"partial: {_signal_name(signum)} stopped {interrupted} (its tables hold the samples that finished{cut}); "
        f"finished: {', '.join(done) or 'none'}; not run: {', '.join(not_run) or 'none'}"
    )


def run_eval_command(console: Console, **cli_options) -> Path:
    """The `mtrain eval` command: the options of `parse_options`, by name, as Typer parsed them."""
    return run_eval(parse_options(**cli_options), console)

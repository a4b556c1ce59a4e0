"""The evaluation jobs of the extension experiment: which `mtrain eval` runs and layer
probes, in which order, side by side on the one GPU within the time budget.

Order, one job (--phase all): perplexity of every model, a round of each retrieval suite, the longest first by the
scale's guess (suite_s: RULER up to 64K, NIAH at 256K) so that shorter ones fill the time beside it, the sparse
layer probes, then more rounds (other --seed) while time lasts. Jobs of their own (--phase base, extend, eval):
first what only this job can evaluate, the extended models (their round 0 in the order above); then the base at
its own context, every round (the issue's base figures, cheap at the base context), and base+YaRN's round 0;
then the extended models' further rounds, then base+YaRN's, these only at the two longest lengths: there the
scores are not saturated (every model found every needle up to 16K in the first run) and decide whether sparse
is within 2 points of dense, and a round there costs 2/5 of one at every length. An eval an earlier job passed
is not run again; one it skipped is, in its place. Before a job starts its wall time is estimated (measured on
the same kind of job at the same lengths, in this job or an earlier one; else the scale's first guess): a job
that cannot end before the deadline, with LAUNCH_MARGIN to spare, is skipped; one still running at the deadline is
stopped. Both are recorded with the reason.

RULER runs its niah tasks, the ones the issue names (RULER_TASKS); InfiniteBench the scale's tasks (ib_tasks).
Answers are generated token by token, `--batch-size` (the scale's eval_batch) prompts at a time. With the scale's
sparse_prefill, the sparse-extended model is evaluated twice: with dense attention ("sparse") and, in those
suites, with sparse prefill ("sparse-prefill", from its run's dense_below up: shorter prompts run dense). At a
scale with alone_from, NIAH and RULER run each length from it up in a process of its own (a 256K prompt fills a
GPU), longest first; with suites_together, a process runs every suite of a model at the same round, at every
length of any (where start-up is most of each). On several GPUs every process sees one (CUDA_VISIBLE_DEVICES:
the one with the most room), `concurrency` of them side by side on each; at a scale with alone_from a process
takes a GPU's share by its longest prompt (gpu_slots): one holding a 256K prompt (66 GiB of an 80 GB H100 at the
256k scale, where two evals beside it ran out of memory) runs alone, a 128K one takes half.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from bench.extension.job import Job, Record, stop
from bench.extension.markdown import MODELS, label
from bench.extension.scales import Scale
from mtrain_cli.eval import FAR_BEYOND_CONTEXT, SUITES
from mtrain_cli.eval.ruler import TASK_NAMES

# A job starts only if its estimate times this ends before the deadline: side by side the estimates ran 10-25%
# short, and a job stopped at the deadline only takes GPU and CPU time from the ones that could finish.
LAUNCH_MARGIN = 1.25
SUITE_ORDER = ("pg19", "niah", "infinitebench", "ruler")
# What a job may evaluate (--evals): the suites, the sparse layer probes, and the sparse run's step profile
EVALS = (*SUITE_ORDER, "probe", "profile")
# The others (vt, cwe, fwe; qa needs SQuAD/HotpotQA files) scored at most 8% for every model at every length in
# every 64K run (bench/extension/results: the 64K runs), took 3 of 11 tasks' prompts and the longest
# answers (30, 120 and 50 tokens against ~15; a batch decodes for its longest), and kept RULER from fitting a job
RULER_TASKS = ",".join(name for name in TASK_NAMES if name.startswith("niah_"))
SPLIT_SUITES = ("niah", "ruler")  # tens of prompts a length: their long lengths split into processes (alone_from)


@dataclass
class EvalTask:
    name: str
    model: str  # base, base-yarn, dense, sparse or sparse-prefill
    kind: str  # a suite, several (comma-separated: suites_together) or "probe"
    lengths: tuple[int, ...]
    seed: int = 0
    samples: int = 1


def eval_tasks(
    scale: Scale, models: dict[str, Path], phase: str, sparse_from: int = 0, evals: tuple[str, ...] = EVALS
) -> list[EvalTask]:
    """Every eval job this phase may run, most important first (the module's docstring). sparse_from: the
    shortest length sparse-prefill is evaluated at (its run's dense_below: shorter prompts run dense attention);
    evals: the suites and probes chosen (--evals), the others left out."""

    def lengths(model: str, kind: str) -> tuple[int, ...]:
        if model == "base" and kind != "pg19":
            return tuple(n for n in scale.lengths if n <= scale.base_context)
        if model == "base":  # perplexity past its context, as far as `mtrain eval` runs without --force-lengths
            return tuple(n for n in scale.lengths if n <= FAR_BEYOND_CONTEXT * scale.base_context)
        if model == "sparse-prefill":
            return tuple(n for n in scale.lengths if n >= sparse_from)
        return scale.lengths

    def groups(kind: str, lengths: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The processes of a suite at `lengths`: each from alone_from up alone, longest first, then the rest."""
        if scale.alone_from is None or kind not in SPLIT_SUITES:
            return [lengths]
        short = tuple(n for n in lengths if n < scale.alone_from)
        return [(n,) for n in sorted(set(lengths) - set(short), reverse=True)] + ([short] if short else [])

    samples = {
        "pg19": scale.books,
        "niah": scale.niah_samples,
        "infinitebench": scale.ib_samples,
        "ruler": scale.ruler_samples,
    }

    def suites(names: list[str], kinds: tuple[str, ...], seeds, only: tuple[int, ...] = ()) -> list[EvalTask]:
        """only: these lengths, not every one the model is evaluated at."""
        return [
            EvalTask(
                f"eval-{m}-{kind}"
                + ("" if kind == "pg19" else f"-s{seed}")
                + (f"-{'-'.join(map(label, group))}" if scale.alone_from and kind in SPLIT_SUITES else ""),
                m,
                kind,
                group,
                seed,
                samples[kind],
            )
            for seed in seeds
            for kind in kinds
            for m in names
            if m in models and (m != "sparse-prefill" or kind in scale.sparse_prefill)
            for group in groups(kind, tuple(n for n in lengths(m, kind) if not only or n in only))
            if group
        ]

    retrieval, later_rounds = SUITE_ORDER[1:], range(1, scale.rounds)
    probes = [EvalTask(f"probe-{m}", m, "probe", scale.lengths) for m in ("sparse", "dense") if m in models]

    def round_zero(names: list[str]) -> list[EvalTask]:
        # perplexity (cheap, and the first figure), then the longest suite first by the scale's guess: started
        # last, RULER did not fit what the 64K extend job had left (~200 s needed, 115 s left), and at 256K NIAH
        # (the floors' suite) did not fit behind RULER in either extension job
        longest_first = sorted(retrieval, key=lambda kind: -scale.suite_s.get(kind, 0.0))
        return (
            suites(names, ("pg19",), [0])
            + [task for kind in longest_first for task in suites(names, (kind,), [0])]
            + [p for p in probes if p.model in names]
        )

    if phase == "all":
        tasks = round_zero(list(MODELS)) + suites(list(MODELS), retrieval, later_rounds)
    else:
        extended, untrained = ["dense", "sparse", "sparse-prefill"], ["base", "base-yarn"]
        longest = tuple(n for n in scale.lengths if n >= scale.lengths[-1] // 2)
        tasks = (
            round_zero(extended)
            + suites(untrained, ("pg19",), [0])
            + suites(["base"], retrieval, range(scale.rounds))
            + suites(["base-yarn"], retrieval, [0])
            + suites(extended, retrieval, later_rounds, longest)
            + suites(["base-yarn"], retrieval, later_rounds, longest)
        )
    tasks = [task for task in tasks if task.kind in evals]
    return together(tasks) if scale.suites_together else tasks


def together(tasks: list[EvalTask]) -> list[EvalTask]:
    """One task for every suite of a model at the same round and samples, where the first of them was, at every
    length one of them runs at (the base's retrieval then runs beyond its context too)."""
    merged: dict[tuple, EvalTask] = {}
    for task in tasks:
        key = (task.model, task.seed, task.samples) if task.kind != "probe" else (task.name,)
        if key not in merged:
            merged[key] = EvalTask(**asdict(task))
            continue
        first = merged[key]
        first.kind += f",{task.kind}"
        first.name = f"eval-{task.model}-{first.kind.replace(',', '-')}-s{task.seed}"
        first.lengths = tuple(sorted(set(first.lengths) | set(task.lengths)))
    return list(merged.values())


def pending_tasks(job: Job, models: dict[str, Path]) -> list[EvalTask]:
    """The eval jobs of `models` (with sparse-prefill: the sparse run's) that no earlier job passed."""
    passed, _done = earlier_evals(job)
    evaluated = with_sparse_prefill(job, models)
    sparse_from = 0
    if "sparse-prefill" in evaluated:
        run_config = yaml.safe_load((models["sparse"] / "config.yaml").read_text())
        sparse_from = run_config["attention"]["dense_below"]
    tasks = eval_tasks(job.scale, evaluated, job.phase, sparse_from, job.args.evals)
    return [t for t in tasks if t.name not in passed]


def with_sparse_prefill(job: Job, models: dict[str, Path]) -> dict[str, Path]:
    """The models evaluated: with the scale's sparse_prefill, the sparse run a second time, with sparse prefill."""
    if job.scale.sparse_prefill and "sparse" in models:
        return {**models, "sparse-prefill": models["sparse"]}
    return models


def eval_command(job: Job, task: EvalTask, models: dict[str, Path], attention_from: Path | None) -> list[str]:
    heldout, out = job.work / "corpus" / "heldout", job.work / "evals" / task.name
    shutil.rmtree(out, ignore_errors=True)
    lengths = ",".join(map(str, task.lengths))
    if task.kind == "probe":
        return [
            job.args.python,
            "-m",
            "bench.extension.sparsity_by_layer",
            str(models[task.model]),
            "--text-dir",
            str(heldout),
            "--lengths",
            lengths,
            "--attention-from",
            str(attention_from),
            "--out",
            str(out / "probe.json"),
        ]
    kinds = task.kind.split(",")
    chosen = {"ruler": RULER_TASKS, "infinitebench": job.scale.ib_tasks}  # None: every task
    named = [chosen.get(kind) or ",".join(SUITES[kind].tasks) for kind in kinds]
    data = (
        (["--pg19-dir", str(heldout)] if "pg19" in kinds else [])
        + (["--haystack-dir", str(heldout)] if {"niah", "ruler"} & set(kinds) else [])
        + (["--batch-size", str(job.scale.eval_batch)] if set(kinds) - {"pg19"} else [])
        + (["--tasks", ",".join(named)] if any(chosen.get(kind) for kind in kinds) else [])
        + (["--attention", "sparse"] if task.model == "sparse-prefill" else [])
    )
    return job.mtrain(
        "eval",
        str(models[task.model]),
        "--suite",
        task.kind,
        "--lengths",
        lengths,
        "--samples",
        str(task.samples),
        "--seed",
        str(task.seed),
        "--out",
        str(out),
        *data,
    )


def estimate_s(job: Job, task: EvalTask, done: list[tuple[EvalTask, float]]) -> float:
    """The longest measured wall time of the same kind of job at the same lengths; else one measured at as many
    tokens or more, scaled down by the tokens of its lengths (prompt building and prefill grow with them; a RULER
    round at 32K and 64K took 95+ s against 240 s at every length, when the first guess below said 89); else the
    scale's first guess: start-up, and the rest of each suite's job at every length shared by the lengths, equally
    or (guess_by_tokens) by their tokens. Never scaled up from fewer tokens: at 4K most of a round is per prompt,
    not per token (RULER 35 s at 4K, 240 s at 4K-64K; by tokens, 31x the 4K round's tokens, 728 s, and the 64K
    extend job skipped every RULER round on that guess)."""
    same_kind = [(t, wall) for t, wall in done if t.kind == task.kind]
    if measured := [wall for t, wall in same_kind if t.lengths == task.lengths]:
        return max(measured)
    s = job.scale
    if larger := [(t, wall) for t, wall in same_kind if sum(t.lengths) >= sum(task.lengths)]:
        return max(
            s.eval_startup_s + (wall - s.eval_startup_s) * sum(task.lengths) / sum(t.lengths) for t, wall in larger
        )
    if s.guess_by_tokens:
        share = sum(task.lengths) / sum(s.lengths)
    else:
        share = len(task.lengths) / len(s.lengths)
    return s.eval_startup_s + sum(s.suite_s[kind] - s.eval_startup_s for kind in task.kind.split(",")) * share


def earlier_evals(job: Job) -> tuple[set[str], list[tuple[EvalTask, float]]]:
    """(names of the eval jobs an earlier job passed, (task, wall seconds) of each: measured times to plan with)."""
    passed = [r for r in job.records if r.name.startswith(("eval-", "probe-")) and r.status == "pass"]
    keys = {f.name for f in fields(EvalTask)}
    tasks = [
        EvalTask(**{**{k: v for k, v in r.meta.items() if k in keys}, "lengths": tuple(r.meta["lengths"])})
        for r in passed
    ]
    return {r.name for r in passed}, [(task, r.wall_s) for task, r in zip(tasks, passed)]


def gpu_slots(scale: Scale, task: EvalTask, per_gpu: int) -> int:
    """Of a GPU's `per_gpu` places, those a process takes: by its longest prompt against the scale's longest at a
    scale with alone_from (memory grows with the prompt), else one."""
    if scale.alone_from is None:
        return 1
    return min(per_gpu, max(1, math.ceil(per_gpu * max(task.lengths) / max(scale.lengths))))


def eval_phase(job: Job, models: dict[str, Path]) -> None:
    """Runs the pending eval jobs of `models` in order while the budget lasts (the module's docstring)."""
    deadline = job.deadline - job.scale.report_s
    pending = pending_tasks(job, models)
    models = with_sparse_prefill(job, models)
    _passed, done = earlier_evals(job)  # done: (task, wall seconds) of every job that ended, earlier jobs' too
    # the probes' sparse settings: an extension run's own (dense and sparse runs differ only in attention.mode)
    extension = next((models[m] for m in ("sparse", "dense") if m in models), None)
    attention_from = extension / "config.yaml" if extension is not None else None
    running: dict[str, tuple[EvalTask, Record, subprocess.Popen, float]] = {}
    gpus = job.num_gpus if job.num_gpus > 1 else 0  # one GPU, or none: every process sees what there is
    per_gpu = job.args.concurrency or job.scale.concurrency
    on_gpu = [0] * gpus  # places taken on each (gpu_slots)
    concurrency = per_gpu * max(1, gpus)
    threads = max(1, (os.cpu_count() or 1) // concurrency)
    env = dict(job.env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    while pending or running:
        while pending and len(running) < concurrency:
            slots = gpu_slots(job.scale, pending[0], per_gpu) if gpus else 0
            if gpus and per_gpu - min(on_gpu) < slots:
                break  # in order: the next process waits for a GPU with room
            task = pending.pop(0)
            rec = Record(task.name, run_dir=str(job.work / "evals" / task.name), meta=asdict(task))
            job.add(rec)
            need, left = estimate_s(job, task, done), deadline - time.time()
            if need * LAUNCH_MARGIN > left:
                rec.status, rec.reason = "skipped", f"time budget: ~{need:.0f} s needed, {max(0, left):.0f} s left"
                continue
            task_env = env
            if gpus:
                gpu = rec.meta["gpu"] = on_gpu.index(min(on_gpu))
                rec.meta["gpu_slots"] = slots
                on_gpu[gpu] += slots
                task_env = dict(env, CUDA_VISIBLE_DEVICES=str(gpu))
            running[task.name] = (
                task,
                rec,
                job.launch(rec, eval_command(job, task, models, attention_from), task_env),
                time.time(),
            )
        time.sleep(0.5)
        for name, (task, rec, proc, started) in list(running.items()):
            if proc.poll() is not None:
                job.finish(rec, proc.returncode, time.time() - started)
                done.append((task, time.time() - started))
            elif time.time() > deadline:
                stop(proc)
                if any(Path(rec.run_dir).glob("eval-*/summary.md")):  # written last: it had finished, on its way out
                    job.finish(rec, 0, time.time() - started)
                    rec.rc, rec.reason = None, "stopped at the time budget's end, after writing all its results"
                    done.append((task, time.time() - started))
                else:
                    job.finish(rec, None, time.time() - started, "stopped at the time budget's end")
            else:
                continue
            del running[name]
            if "gpu" in rec.meta:
                on_gpu[rec.meta["gpu"]] -= rec.meta["gpu_slots"]
            job.write()

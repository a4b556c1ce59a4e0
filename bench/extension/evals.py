"""The evaluation jobs of the extension experiment: which `mtrain eval` runs and layer
probes, in which order, side by side on the one GPU within the time budget.

Order, one job (--phase all): perplexity of every model, a round of RULER (the longest job, started first so that
shorter ones fill the time beside it), of NIAH and of InfiniteBench, the sparse layer probes, then more rounds
(other --seed) while time lasts. Jobs of their own (--phase base, extend, eval): first what only this job can
evaluate, the extended models (their round 0 in the order above); then the base at its own context, every round
(the issue's base figures, cheap at the base context), and base+YaRN's round 0;
then the extended models' further rounds, then base+YaRN's, these only at the two longest lengths: there the
scores are not saturated (every model found every needle up to 16K in the first run) and decide whether sparse
is within 2 points of dense, and a round there costs 2/5 of one at every length. An eval an earlier job passed
is not run again; one it skipped is, in its place. Before a job starts its wall time is estimated (measured on
the same kind of job at the same lengths, in this job or an earlier one; else the scale's first guess): a job
that cannot end before the deadline, with LAUNCH_MARGIN to spare, is skipped; one still running at the deadline is
stopped. Both are recorded with the reason.

RULER runs its niah tasks, the ones the issue names (RULER_TASKS). Answers are generated token by token,
`--batch-size` (the scale's eval_batch) prompts at a time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from bench.extension.job import Job, Record, stop
from bench.extension.markdown import MODELS
from bench.extension.scales import Scale
from mtrain_cli.eval.ruler.suite import TASK_NAMES

# A job starts only if its estimate times this ends before the deadline: side by side the estimates ran 10-25%
# short, and a job stopped at the deadline only takes GPU and CPU time from the ones that could finish.
LAUNCH_MARGIN = 1.25
SUITE_ORDER = ("pg19", "niah", "infinitebench", "ruler")
# The others (vt, cwe, fwe; qa needs SQuAD/HotpotQA files) scored at most 8% for every model at every length in
# every 64K run (bench/results/extension_experiment_h100_multi*.json), took 3 of 11 tasks' prompts and the longest
# answers (30, 120 and 50 tokens against ~15; a batch decodes for its longest), and kept RULER from fitting a job
RULER_TASKS = ",".join(name for name in TASK_NAMES if name.startswith("niah_"))


@dataclass
class EvalTask:
    name: str
    model: str  # base, base-yarn, dense or sparse
    kind: str  # a suite or "probe"
    lengths: tuple[int, ...]
    seed: int = 0
    samples: int = 1


def eval_tasks(scale: Scale, models: dict[str, Path], phase: str) -> list[EvalTask]:
    """Every eval job this phase may run, most important first (the module's docstring)."""

    def lengths(model: str, kind: str) -> tuple[int, ...]:
        if model == "base" and kind != "pg19":
            return tuple(n for n in scale.lengths if n <= scale.base_context)
        return scale.lengths

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
                f"eval-{m}-{kind}" + ("" if kind == "pg19" else f"-s{seed}"),
                m,
                kind,
                only or lengths(m, kind),
                seed,
                samples[kind],
            )
            for seed in seeds
            for kind in kinds
            for m in names
            if m in models
        ]

    retrieval, later_rounds = SUITE_ORDER[1:], range(1, scale.rounds)
    probes = [EvalTask(f"probe-{m}", m, "probe", scale.lengths) for m in ("sparse", "dense") if m in models]

    def round_zero(names: list[str]) -> list[EvalTask]:
        # perplexity (cheap, and the first figure), then the longest job first: started last, RULER did not fit
        # what the 64K extend job had left (~200 s needed, 115 s left) while shorter jobs had filled the time
        return (
            suites(names, ("pg19",), [0])
            + suites(names, ("ruler",), [0])
            + suites(names, ("niah", "infinitebench"), [0])
            + [p for p in probes if p.model in names]
        )

    if phase == "all":
        return round_zero(list(MODELS)) + suites(list(MODELS), retrieval, later_rounds)
    extended, untrained = ["dense", "sparse"], ["base", "base-yarn"]
    longest = tuple(n for n in scale.lengths if n >= scale.lengths[-1] // 2)
    return (
        round_zero(extended)
        + suites(untrained, ("pg19",), [0])
        + suites(["base"], retrieval, range(scale.rounds))
        + suites(["base-yarn"], retrieval, [0])
        + suites(extended, retrieval, later_rounds, longest)
        + suites(["base-yarn"], retrieval, later_rounds, longest)
    )


def eval_command(job: Job, task: EvalTask, models: dict[str, Path], sparse_config: Path | None) -> list[str]:
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
            str(sparse_config),
            "--out",
            str(out / "probe.json"),
        ]
    batch = ["--batch-size", str(job.scale.eval_batch)]
    data = {
        "pg19": ["--pg19-dir", str(heldout)],
        "niah": ["--haystack-dir", str(heldout), *batch],
        "ruler": ["--haystack-dir", str(heldout), "--tasks", RULER_TASKS, *batch],
        "infinitebench": batch,
    }[task.kind]
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
    scale's first guess: start-up, and the rest of a job at every length shared by the lengths. Never scaled up
    from fewer tokens: at 4K most of a round is per prompt, not per token (RULER 35 s at 4K, 240 s at 4K-64K; by
    tokens, 31x the 4K round's tokens, 728 s, and the 64K extend job skipped every RULER round on that guess)."""
    same_kind = [(t, wall) for t, wall in done if t.kind == task.kind]
    if measured := [wall for t, wall in same_kind if t.lengths == task.lengths]:
        return max(measured)
    s = job.scale
    if larger := [(t, wall) for t, wall in same_kind if sum(t.lengths) >= sum(task.lengths)]:
        return max(
            s.eval_startup_s + (wall - s.eval_startup_s) * sum(task.lengths) / sum(t.lengths) for t, wall in larger
        )
    return s.eval_startup_s + (s.suite_s[task.kind] - s.eval_startup_s) * len(task.lengths) / len(s.lengths)


def earlier_evals(job: Job) -> tuple[set[str], list[tuple[EvalTask, float]]]:
    """(names of the eval jobs an earlier job passed, (task, wall seconds) of each: measured times to plan with)."""
    passed = [r for r in job.records if r.name.startswith(("eval-", "probe-")) and r.status == "pass"]
    keys = {f.name for f in fields(EvalTask)}
    tasks = [
        EvalTask(**{**{k: v for k, v in r.meta.items() if k in keys}, "lengths": tuple(r.meta["lengths"])})
        for r in passed
    ]
    return {r.name for r in passed}, [(task, r.wall_s) for task, r in zip(tasks, passed)]


def eval_phase(job: Job, models: dict[str, Path], sparse_config: Path | None) -> None:
    deadline = job.deadline - job.scale.report_s
    passed, done = earlier_evals(job)  # done: (task, wall seconds) of every job that ended, earlier jobs' too
    pending = [
        t
        for t in eval_tasks(job.scale, models, job.phase)
        if t.name not in passed and (t.kind != "probe" or sparse_config is not None)
    ]
    running: dict[str, tuple[EvalTask, Record, subprocess.Popen, float]] = {}
    concurrency = job.args.concurrency or job.scale.concurrency
    threads = max(1, (os.cpu_count() or 1) // concurrency)
    env = dict(job.env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    while pending or running:
        while pending and len(running) < concurrency:
            task = pending.pop(0)
            rec = Record(task.name, run_dir=str(job.work / "evals" / task.name), meta=asdict(task))
            job.add(rec)
            need, left = estimate_s(job, task, done), deadline - time.time()
            if need * LAUNCH_MARGIN > left:
                rec.status, rec.reason = "skipped", f"time budget: ~{need:.0f} s needed, {max(0, left):.0f} s left"
                continue
            running[task.name] = (
                task,
                rec,
                job.launch(rec, eval_command(job, task, models, sparse_config), env),
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
            job.write()

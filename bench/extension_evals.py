"""The evaluation jobs of bench/extension_experiment.py (not run on its own): which `mtrain eval` runs and layer
probes, in which order, side by side on the one GPU within the time budget.

Order: perplexity of every model, a round of NIAH and InfiniteBench, the sparse layer probes, a round of RULER,
then more rounds (other --seed) while time lasts. Before a job starts its wall time is estimated (measured on
the same kind of job at the same lengths, else the scale's first guess): a job that cannot end before the
deadline is skipped; one still running at the deadline is stopped. Both are recorded with the reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extension_experiment import Job, Scale

REPO = Path(__file__).resolve().parents[1]
SUITE_ORDER = ("pg19", "niah", "infinitebench", "ruler")


@dataclass
class Record:
    """One subprocess: a phase, an eval job or a probe."""
    name: str
    command: str = ""
    status: str = "pending"  # pass | fail | skipped
    reason: str = ""
    rc: int | None = None
    wall_s: float | None = None
    run_dir: str | None = None  # what it wrote (run, eval or probe output)
    meta: dict = field(default_factory=dict)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this script started."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class EvalTask:
    name: str
    model: str  # base, base-yarn, dense or sparse
    kind: str  # a suite or "probe"
    lengths: tuple[int, ...]
    seed: int = 0
    samples: int = 1


def eval_tasks(scale: Scale, models: dict[str, Path]) -> list[EvalTask]:
    """Most important first: perplexity, a round of NIAH and InfiniteBench, the layer probe (cheap), a round of
    RULER, then more rounds (other seeds)."""
    def lengths(model: str, kind: str) -> tuple[int, ...]:
        if model == "base" and kind != "pg19":
            return tuple(n for n in scale.lengths if n <= scale.base_context)
        return scale.lengths

    samples = {"niah": 1, "infinitebench": scale.ib_samples, "ruler": 1}
    tasks = [EvalTask(f"eval-{m}-pg19", m, "pg19", lengths(m, "pg19"), samples=scale.books) for m in models]
    for kind in SUITE_ORDER[1:]:
        if kind == "ruler":
            tasks += [EvalTask(f"probe-{m}", m, "probe", scale.lengths) for m in ("sparse", "dense") if m in models]
        tasks += [EvalTask(f"eval-{m}-{kind}-s0", m, kind, lengths(m, kind), 0, samples[kind]) for m in models]
    for seed in range(1, scale.rounds):
        for kind in SUITE_ORDER[1:]:
            tasks += [EvalTask(f"eval-{m}-{kind}-s{seed}", m, kind, lengths(m, kind), seed, samples[kind])
                      for m in models]
    return tasks


def eval_command(job: Job, task: EvalTask, models: dict[str, Path], sparse_config: Path | None) -> list[str]:
    heldout, out = job.work / "corpus" / "heldout", job.work / "evals" / task.name
    shutil.rmtree(out, ignore_errors=True)
    lengths = ",".join(map(str, task.lengths))
    if task.kind == "probe":
        return [job.args.python, str(REPO / "bench" / "sparsity_by_layer.py"), str(models[task.model]),
                "--text-dir", str(heldout), "--lengths", lengths, "--attention-from", str(sparse_config),
                "--out", str(out / "probe.json")]
    data = {"pg19": ["--pg19-dir", str(heldout)], "niah": ["--haystack-dir", str(heldout)],
            "ruler": ["--haystack-dir", str(heldout)], "infinitebench": []}[task.kind]
    return job.mtrain("eval", str(models[task.model]), "--suite", task.kind, "--lengths", lengths,
                      "--samples", str(task.samples), "--seed", str(task.seed), "--out", str(out), *data)


def estimate_s(job: Job, task: EvalTask, done: list[tuple[EvalTask, float]]) -> float:
    """The longest measured wall time of the same kind of job at the same lengths; else the scale's first guess,
    scaled by the lengths' token count (process start-up makes measured times scale worse than that)."""
    measured = [wall for t, wall in done if t.kind == task.kind and t.lengths == task.lengths]
    if measured:
        return max(measured)
    return job.scale.suite_s[task.kind] * sum(task.lengths) / sum(job.scale.lengths)


def eval_phase(job: Job, models: dict[str, Path], sparse_config: Path | None) -> None:
    deadline = job.deadline - job.scale.report_s
    pending = [t for t in eval_tasks(job.scale, models) if t.kind != "probe" or sparse_config is not None]
    running: dict[str, tuple[EvalTask, Record, subprocess.Popen, float]] = {}
    done: list[tuple[EvalTask, float]] = []  # (task, wall seconds) of every job that ended
    concurrency = job.args.concurrency or job.scale.concurrency
    threads = max(1, (os.cpu_count() or 1) // concurrency)
    env = dict(job.env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    while pending or running:
        while pending and len(running) < concurrency:
            task = pending.pop(0)
            rec = Record(task.name, run_dir=str(job.work / "evals" / task.name), meta=asdict(task))
            job.records.append(rec)
            need, left = estimate_s(job, task, done), deadline - time.time()
            if need > left:
                rec.status, rec.reason = "skipped", f"time budget: ~{need:.0f} s needed, {max(0, left):.0f} s left"
                continue
            running[task.name] = (task, rec, job.launch(rec, eval_command(job, task, models, sparse_config), env),
                                  time.time())
        time.sleep(0.5)
        for name, (task, rec, proc, started) in list(running.items()):
            if proc.poll() is not None:
                job.finish(rec, proc.returncode, time.time() - started)
                done.append((task, time.time() - started))
            elif time.time() > deadline:
                stop(proc)
                job.finish(rec, None, time.time() - started, "stopped at the time budget's end")
            else:
                continue
            del running[name]
            job.write()

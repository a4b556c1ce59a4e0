"""The runner: the work directory, the machine's environment, the local data and recipe, then each chosen flow in
order within the time budget (skipped, with the reason, when a prerequisite did not pass or time is short), the
results rewritten after every flow."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
import traceback

from bench.gpu_e2e.data import make_data, recipe
from bench.gpu_e2e.environment import environment
from bench.gpu_e2e.job import Flow, Job, Record, kill_group
from bench.gpu_e2e.scales import Scale


def run_flows(args: argparse.Namespace, scale: Scale, chosen: list[Flow]) -> None:
    job = Job(args, scale)
    shutil.rmtree(job.work, ignore_errors=True)
    for sub in ("logs", "data", "runs", "evals", "profile"):
        (job.work / sub).mkdir(parents=True, exist_ok=True)
    job.records = [Record(f.name, f.kind, f.description) for f in chosen]

    def on_signal(signum, _frame):
        if job.current is not None:
            kill_group(job.current)
        for r in job.records:
            if r.status == "pending":
                r.status, r.reason = "skipped", f"the job got signal {signum} before this flow ran"
        job.write(final=False)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    job.header = environment(job)
    job.header.update(
        flows_selected=[f.name for f in chosen],
        sizes={
            "native": scale.native,
            "short": scale.short,
            "long": scale.long,
            "model": scale.model,
            "attention": scale.attention,
            "extend_steps": scale.extend_steps,
            "pretrain_steps": scale.pretrain_steps,
            "pretrain_batch": scale.pretrain_batch,
            "resume_steps": scale.resume_steps,
            "eval_lengths": scale.eval_lengths,
        },
    )
    print(f"gpu_e2e: {job.tag} · {len(chosen)} flows · {job.left():.0f} s left · work {job.work}", flush=True)
    if job.header.get("missing_imports"):
        print(f"gpu_e2e: MISSING imports: {job.header['missing_imports']}", flush=True)
    job.write()
    t0 = time.time()
    try:
        job.state.data = make_data(job)
        recipe(job)
        job.header["data_prep_s"] = round(time.time() - t0, 1)
    except Exception as exc:
        for r in job.records:
            r.status, r.reason = "skipped", f"data preparation failed: {exc!r}"
        job.write(final=True)
        raise
    records = {r.name: r for r in job.records}
    for f in chosen:
        rec = records[f.name]
        bad = [d for d in f.deps if d in records and records[d].status != "pass"]
        left = job.left() - 10  # keep time to write the results
        if bad:
            rec.status = "skipped"
            rec.reason = "prerequisite " + ", ".join(f"{d} {records[d].status}" for d in bad)
            rec.budget_skip = all(records[d].budget_skip for d in bad)
        elif left < f.min_s:
            rec.status, rec.budget_skip = "skipped", True
            rec.reason = f"time budget: {max(0, left):.0f} s left, this flow needs at least {f.min_s:.0f} s"
        else:
            rec.timeout_s = min(scale.timeouts[f.kind], left)
            print(f"gpu_e2e: {f.name} (timeout {rec.timeout_s:.0f} s) ...", flush=True)
            try:
                f.run(job, rec)
            except Exception as exc:
                rec.status = "fail"
                rec.reason = f"driver error: {exc!r}"
                rec.stderr_tail = traceback.format_exc()[-3000:]
            if rec.timed_out and rec.timeout_s < scale.timeouts[f.kind]:  # the budget, not the flow, ran out
                rec.status, rec.budget_skip = "skipped", True
                rec.reason = (
                    f"time budget: stopped after {rec.wall_s:.0f} s at the job's end (its own timeout is "
                    f"{scale.timeouts[f.kind]} s); " + rec.reason
                )
        print(f"gpu_e2e: {f.name}: {rec.status} {rec.wall_s or 0:.1f} s {rec.reason[:300]}", flush=True)
        job.write()
    job.write(final=True)
    counts = {s: sum(r.status == s for r in job.records) for s in ("pass", "fail", "skipped")}
    print(f"gpu_e2e: done in {time.time() - job.start:.0f} s: {counts} -> {job.out}/gpu_e2e_{job.tag}.md", flush=True)
    print((job.out / f"gpu_e2e_{job.tag}.md").read_text(), flush=True)

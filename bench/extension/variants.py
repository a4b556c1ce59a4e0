"""A sparse job of several variants (--phase sparse --variant TAG [KEY=VALUE ...] ...): the earlier jobs joined and
the corpus rebuilt once, then each variant in turn, as a sparse job of that variant alone would run it: its run
against the same dense run (the common --extend-set and the variant's settings), its model's evals, and its report
(OUT/<stem>_<TAG>.json and .md, the names a one-variant job with --tag TAG writes). Its logs tarball (what that
job leaves) goes into one file of OUT for all of them, <stem>_<TAG>_..._logs.tar, rewritten after each variant;
a device call returns 8 files. Its models are not handed on (no parts): an eval job of what they left is a one-variant
job's. Every variant starts with the time of the longest one before it left in the budget, or is skipped and its
report says so; the first always starts, as a one-variant job. Its evals are its model's alone (with sparse
prefill where the scale has it): what an earlier job left of the base's is an eval job's, not a variant's time.
With --dense-here the first variant's start trains the dense run again (phases.extend), and every variant's report
times against it. Not run on its own."""

from __future__ import annotations

import copy
import os
import tarfile
import time

from bench.extension.evals import eval_phase
from bench.extension.handoff import JobsError
from bench.extension.job import Job, Record
from bench.extension.jobs import added_settings, join_earlier, same_training
from bench.extension.markdown import DENSE_HERE
from bench.extension.phases import corpus_phase, extend


def check_variants(job: Job, earlier: dict) -> None:
    """Every variant's settings against the earlier dense run's (JobsError: one would not compare), before any
    trains."""
    if "extend_steps" not in earlier:
        raise JobsError(
            "--variant: the earlier jobs trained no extension; the variants are set against a dense run (--resume "
            "the dense job's logs)"
        )
    for _tag, sets in job.args.variants:
        added_settings(job.phase, [*job.args.extend_set, *sets], job.args.extend_steps, earlier)


def gather_logs(job: Job) -> None:
    """The variants' logs tarballs so far, as one file in OUT (a plain tar of them)."""
    tags = "_".join(tag for tag, _sets in job.args.variants)
    path = job.out / f"{job.untagged_stem}_{tags}_logs.tar"
    partial = path.with_name(path.name + ".tmp")
    with tarfile.open(partial, "w") as tar:
        for logs in sorted(job.variant_logs.parent.glob("*_logs.tar.gz")):
            tar.add(logs, arcname=logs.name)
    os.replace(partial, path)


def skip(job: Job, reason: str) -> None:
    """The variant's run recorded as skipped, and why, in its report's notes."""
    rec = Record("sparse", status="skipped", reason=reason)
    job.add(rec)
    job.header["notes"].append(f"variant {job.args.tag}: not trained: {reason}")
    print(f"bench.extension: variant {job.args.tag}: not trained: {reason}", flush=True)


def variants_job(job: Job) -> bool:
    """The variants of --variant in turn (the module's docstring). -> every variant trained."""
    joined = join_earlier(job, check=check_variants)
    ready = joined is not None and corpus_phase(job, joined[1]["corpus"])
    common_header, common_records = copy.deepcopy(job.header), copy.deepcopy(job.records)
    common_sets, tags = list(job.args.extend_set), [tag for tag, _sets in job.args.variants]
    walls: list[float] = []  # of each variant that started: its seconds from its start to its report
    trained = []
    for number, (tag, sets) in enumerate(job.args.variants, 1):
        started = time.time()
        job.args.tag, job.args.extend_set = tag, [*common_sets, *sets]
        job.header, job.records = copy.deepcopy(common_header), copy.deepcopy(common_records)
        job.header["variant"] = {"tag": tag, "number": number, "of": tags, "started_s": round(started - job.start, 1)}
        job.header["notes"].append(
            f"variant {number} of {len(tags)} in this job ({', '.join(tags)}), from {started - job.start:.0f} s: the "
            "base joined and the corpus built once for them all"
        )
        need, ran = max(walls, default=0.0), False
        if not ready:
            skip(job, "the job stopped before its variants (its notes say why)")
        elif need > job.left():
            skip(job, f"time budget: ~{need:.0f} s needed (the longest variant so far), {job.left():.0f} s left")
        else:
            ran = True
            same_training(job, joined[2])
            models = dict(joined[0])
            if extend(job, models, ("sparse",)):
                trained.append(tag)
            if "sparse" in models:
                eval_phase(job, {"sparse": models["sparse"]})
        job.write(final=True)
        gather_logs(job)
        if not any(r.name == DENSE_HERE for r in common_records):  # --dense-here: trained once, for every variant
            common_records += [copy.deepcopy(r) for r in job.records if r.name == DENSE_HERE]
        if ran:
            walls.append(time.time() - started)
        print((job.out / f"{job.stem}.md").read_text(), flush=True)
    return trained == tags

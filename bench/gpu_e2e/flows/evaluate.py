"""`mtrain eval` flows: every suite (RULER, NIAH, PG-19, InfiniteBench) on a trained run, dense or sparse, batched
as a user runs it, on the local eval files of data.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bench.gpu_e2e.checks import finish, mean, only_subdir, rnd
from bench.gpu_e2e.job import Flow, Job, Record
from bench.gpu_e2e.scales import Scale

SUITES = ("ruler", "niah", "pg19", "infinitebench")
EVAL_BATCH = 4  # prompts decoded together: the batched path (left padding masked) as a user runs it


def eval_flow(attention: str, run_flow: str) -> Callable[[Job, Record], None]:
    """mtrain eval of the run that flow `run_flow` trained: the four suites at the scale's eval lengths, with
    `attention` dense or sparse, on the local eval files; every suite must score."""

    def run(job: Job, rec: Record) -> None:
        s, d = job.scale, job.state.data
        evals = job.out_dir("evals", rec.name)
        cmd = job.mtrain(
            "eval",
            str(job.state.run_dirs[run_flow]),
            "--suite",
            ",".join(SUITES),
            "--lengths",
            s.eval_lengths,
            "--samples",
            "1",
            "--batch-size",
            str(EVAL_BATCH),
            "--attention",
            attention,
            "--out",
            str(evals),
            "--haystack-dir",
            str(d["haystack"]),
            "--pg19-dir",
            str(d["pg19"]),
            "--squad-file",
            str(d["squad"]),
            "--hotpot-file",
            str(d["hotpot"]),
            "--infinitebench-dir",
            str(d["infinitebench"]),
        )
        if attention == "sparse":
            cmd += ["--sparse-set", f"dense_below={s.eval_dense_below}"]
        job.run(rec, cmd, rec.timeout_s)
        problems, checks = [], []
        run_dir = only_subdir(evals)
        results_file = run_dir / "results.json" if run_dir else None
        if results_file is None or not results_file.is_file():
            problems.append("no results.json")
            results = {}
        else:
            rec.artifacts["results"] = str(results_file)
            results = json.loads(results_file.read_text())
        suites = results.get("suites") or {}
        summary: dict[str, Any] = {}
        for name in SUITES:
            suite = suites.get(name)
            if suite is None:
                if results:
                    problems.append(f"suite {name} missing from results.json")
                continue
            rows = suite.get("rows") or {}
            cells = [v for row, cellmap in rows.items() if row != "mean" for v in cellmap.values()]
            headline = list((rows.get("mean") or rows.get("perplexity") or {}).values())
            summary[name] = {
                "cells": len(cells),
                "headline": rnd(mean(headline) if headline else mean(cells), 3),
                "metric": suite.get("metric"),
                "skipped": len(suite.get("skipped") or []),
            }
            if not cells:
                problems.append(f"suite {name}: no scores ({len(suite.get('skipped') or [])} skipped)")
        rec.metrics["suites"] = summary
        rec.metrics["eval_wall_s"] = results.get("wall_time_s")
        rec.metrics["batch_size"] = results.get("batch_size")
        if results and results.get("batch_size") != EVAL_BATCH:
            problems.append(f"results.json says batch_size {results.get('batch_size')}, the command asked {EVAL_BATCH}")
        rec.metrics["skipped"] = [
            f"{x['suite']}/{x['task']}" + (f"@{x['length']}" if x.get("length") else "") + f": {x['reason'][:90]}"
            for x in results.get("skipped") or []
        ]
        rec.metrics["notes"] = results.get("notes")
        rec.metrics["device"] = results.get("device")
        sparse = results.get("sparse")
        if attention == "sparse":
            if not sparse:
                problems.append("results.json has no sparse section")
            else:
                rec.metrics.update(
                    sparse_density=rnd(sparse.get("sparse_density")),
                    sparse_recall=rnd(sparse.get("sparse_recall")),
                    attention_calls=sparse.get("attention_calls"),
                    prefills=sparse.get("prefills"),
                    prefills_probed=sparse.get("prefills_probed"),
                    settings_source=sparse.get("settings_source"),
                )
                if not (sparse.get("attention_calls") or {}).get(s.sparse_path):
                    problems.append(
                        f"sparse eval: attention_calls {sparse.get('attention_calls')} lack {s.sparse_path}"
                    )
                if not sparse.get("prefills_probed") or sparse.get("sparse_recall") is None:
                    problems.append(
                        f"sparse eval: {sparse.get('prefills_probed')} of {sparse.get('prefills')} "
                        f"prefills "
                        f"probed, recall {sparse.get('sparse_recall')}"
                    )
        elif sparse:
            problems.append("dense eval reports a sparse section")
        if rec.rc != 0:
            problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
        checks.append(
            "suites " + ", ".join(f"{k}: {v['cells']} cells, {v['skipped']} skipped" for k, v in summary.items())
        )
        finish(rec, problems, checks)

    return run


def flows(scale: Scale) -> list[Flow]:
    return [
        Flow(
            f"eval-{attention}",
            "eval",
            f"eval RUN_DIR, 4 suites, {scale.eval_lengths}, {attention}",
            eval_flow(attention, "resume-continue"),
            ("resume-continue",),
            min_s=50,
        )
        for attention in ("dense", "sparse")
    ]

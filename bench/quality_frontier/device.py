"""A call of the study on the device, and what it returned filed here.

`run_call`: each job of the call in turn (bench/extension_experiment.sh with the job's options, its OUT a folder of
its own), started only when what it reads is there and its budget fits what is left of the call; what each job
leaves copied into the call's $OUT (at most 8 files) and to its place under the repository, where a later job of
the same call reads it; $OUT/call.json says what ran, how it ended and where each returned file belongs.
`take`: those files, from the folder the device returned them to, put in their places here.
Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.quality_frontier.schedule import CALL_S, Call, Job, Output

REPO = Path(__file__).resolve().parents[2]
CALL_RECORD = "call.json"
MAX_FILES = 8  # a device call returns at most 8 files
LATE_S = 30  # a job still starts this much past its budget's share: the call's limit is 10 minutes, not 9
SCRIPT = ("bash", "bench/extension_experiment.sh")


def place(source: Path, target: Path) -> None:
    """A copy of file or folder `source` at `target`, replacing what was there."""
    if target.resolve() == source.resolve():
        return
    if target.is_dir():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)


def resolve(output: Output, job_out: Path) -> list[tuple[Path, str, str]]:
    """Each file or folder the job left that `output` names (a glob may name several: a sparse job's variants'
    reports), with its name in $OUT and its place under the repository; none: not left."""
    reports = sorted(job_out.glob("*.json"))
    stem = reports[0].stem if reports else "report"
    return [
        (found, output.returned.format(name=found.name, stem=stem), output.dest.format(name=found.name, stem=stem))
        for found in sorted(job_out.glob(output.source))
    ]


def run_job(job: Job, job_out: Path, left_s: float, out: Path, repo: Path, runner=subprocess.run) -> dict[str, Any]:
    """One job of a call, if it can start; what it left copied into `out` and under `repo`. -> its record."""
    record: dict[str, Any] = {"job": job.name, "command": " ".join((*SCRIPT, *job.script_args)), "copies": []}
    missing = [path for path in job.needs if not (repo / path).exists()]
    if missing:
        record.update(status="skipped", reason=f"missing {', '.join(missing)}: carry them (`plan` lists them)")
        return record
    if job.budget_s > left_s + LATE_S:
        record.update(
            status="skipped",
            reason=f"{left_s:.0f} s of the call were left for a budget of {job.budget_s} s: run it in a call again",
        )
        return record
    shutil.rmtree(job_out, ignore_errors=True)
    job_out.mkdir(parents=True)
    started = time.time()
    print(f"quality_frontier: {record['command']}", flush=True)
    rc = runner([*SCRIPT, *job.script_args], cwd=repo, env={**os.environ, "OUT": str(job_out)}).returncode
    record.update(status="pass" if rc == 0 else "fail", rc=rc, wall_s=round(time.time() - started, 1))
    for output in job.outputs:
        found = resolve(output, job_out)
        if not found:
            record.setdefault("not_left", []).append(output.source)
        for source, returned, dest in found:
            place(source, out / returned)
            place(source, repo / dest)
            record["copies"].append([returned, dest])
    return record


def run_call(call: Call, out: Path, repo: Path = REPO, work: Path = Path("/tmp/quality_frontier"), runner=None):
    """The call's jobs in turn (`runner`: subprocess.run, or a stand-in in tests). -> exit code: 0 when every job
    passed."""
    out.mkdir(parents=True, exist_ok=True)
    started, records = time.time(), []
    for index, job in enumerate(call.jobs):
        left = CALL_S - (time.time() - started)
        records.append(run_job(job, work / f"job{index}", left, out, repo, runner or subprocess.run))
        summary = {"model": call.model, "call": call.name, "command": call.command, "jobs": records}
        (out / CALL_RECORD).write_text(json.dumps(summary, indent=1) + "\n")
    files = [p for p in out.rglob("*") if p.is_file()]
    for record in records:
        print(f"quality_frontier: {record['job']}: {record['status']} {record.get('reason', '')}", flush=True)
    if len(files) > MAX_FILES:
        print(f"quality_frontier: $OUT holds {len(files)} files; a call returns {MAX_FILES}", file=sys.stderr)
        return 1
    return 0 if all(record["status"] == "pass" for record in records) else 1


class StaleCall(Exception):
    """What a call returned would replace newer files, or the folder holds another call's copy."""


def report_date(path: Path) -> str | None:
    """A job report's date (its JSON's `date_utc`); None for any other file."""
    if path.suffix != ".json" or not path.is_file():
        return None
    return json.loads(path.read_text()).get("date_utc")


def take(returned: Path, repo: Path = REPO) -> list[str]:
    """The files a call returned (the folder holding its call.json), each put in its place under `repo`, unless a
    report among them is older than the one it would replace (nothing is filed then).
    -> one line per job: how it ended and what was filed."""
    nested = sorted(child.name for child in returned.iterdir() if (child / CALL_RECORD).is_file())
    if nested:
        raise StaleCall(
            f"{returned} holds another call's files in {', '.join(nested)}/ (a copy into a folder that existed): "
            "take the device's files_at itself, or copy each call into a new folder"
        )
    summary = json.loads((returned / CALL_RECORD).read_text())
    for record in summary["jobs"]:
        for name, dest in record["copies"]:
            new, old = report_date(returned / name), report_date(repo / dest)
            if new is not None and old is not None and new < old:
                raise StaleCall(f"{returned / name} ({new}) is older than {dest} ({old}): nothing filed")
    lines = []
    for record in summary["jobs"]:
        for name, dest in record["copies"]:
            place(returned / name, repo / dest)
        filed = ", ".join(dest for _name, dest in record["copies"]) or "nothing"
        lines.append(f"{summary['model']} call {summary['call']}, {record['job']}: {record['status']}; filed {filed}")
        if record.get("reason"):
            lines.append(f"  {record['reason']}")
    return lines

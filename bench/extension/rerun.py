"""One extension trained again, joined into a finished report (`python -m bench.extension.rerun`).

A change that must not move any number (a speed fix) is measured by training one extension again, e.g.
`--phase sparse --tag rerun` with the dense job's logs as --resume. Its evaluations need not run again: when the
rerun's loss equals the earlier run's at every step, bit for bit, both trained the same model, and the earlier
run's evaluations are the rerun's. This writes the earlier report with the rerun's training record, steps and
step profile in place of the earlier run's (its job listed with the others, a note saying so), and refuses, in one
line and exit code 2, when any loss differs.

    python -m bench.extension.rerun --logs extension_experiment_4gpu_256k_logs.tar.gz \\
        --rerun sparse_parts/logs.tar.gz --out DIR      # -> DIR/extension_experiment_4gpu_256k.{json,md,png}
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.extension import handoff
from bench.extension.report import write
from bench.extension.training import read_jsonl

RUNS = ("dense", "sparse")  # the extensions a rerun job may have trained


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m]


def join(
    work: Path,
    header: dict[str, Any],
    records: list[dict[str, Any]],
    rerun_work: Path,
    rerun_header: dict[str, Any],
    rerun_records: list[dict[str, Any]],
) -> str:
    """The rerun job's extension (its state restored under rerun_work) in place of the same extension in the
    report's state (restored under work): run directory, training, corpus and profile records, step profile and
    job entry. -> the extension's name. Raises handoff.JobsError when the runs' losses differ anywhere."""
    job = rerun_header["jobs"][-1]
    name = job["phase"]
    new = next((r for r in rerun_records if r["name"] == name and r["status"] == "pass" and r.get("run_dir")), None)
    old = next((r for r in records if r["name"] == name and r["status"] == "pass" and r.get("run_dir")), None)
    if name not in RUNS or new is None or old is None:
        raise handoff.JobsError(f"the rerun job ({name}) trained no extension that the report has")
    new_losses, old_losses = losses(Path(new["run_dir"])), losses(Path(old["run_dir"]))
    if not new_losses or new_losses != old_losses:
        first = next((i for i, (a, b) in enumerate(zip(new_losses, old_losses)) if a != b), None)
        where = f"at step {first + 1}" if first is not None else f"in length ({len(new_losses)} / {len(old_losses)})"
        raise handoff.JobsError(
            f"the {name} rerun's losses differ from the report's {where}: another model, whose evaluations the report "
            "does not have; evaluate it instead (--phase eval --model-parts)"
        )
    run_dir = work / "runs" / name / Path(new["run_dir"]).name
    for stale in (Path(old["run_dir"]), run_dir):  # one run directory of this extension in the report's logs
        shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(new["run_dir"], run_dir)
    profile = rerun_work / "profile"
    for file in profile.glob(f"{name}.*"):
        (work / "profile").mkdir(exist_ok=True)
        shutil.copy2(file, work / "profile" / file.name)
    replaced = {f"corpus-{name}", name, f"profile-{name}"}
    rerun_by_name = {r["name"]: r for r in rerun_records if r["name"] in replaced and r["meta"].get("job") == name}
    for index, record in enumerate(records):
        if record["name"] in rerun_by_name:
            records[index] = dict(rerun_by_name[record["name"]])
            for key in ("run_dir", "command"):
                if records[index].get(key):
                    records[index][key] = records[index][key].replace(str(rerun_work), str(work))
            if record["name"] == name:
                records[index]["run_dir"] = str(run_dir)
    header["jobs"] = sorted([j for j in header["jobs"] if j["phase"] != name] + [job], key=lambda j: j["date_utc"])
    header["notes"].append(
        f"the {name} run is its rerun (commit {job.get('git_commit', '?')[:12]}, {job.get('date_utc')}): its losses "
        f"equal the earlier run's at all {len(new_losses)} steps, so the evaluations of the earlier run's model are "
        "its own"
    )
    return name


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.extension.rerun",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--logs", type=Path, required=True, help="the report's logs tarball (<stem>_logs.tar.gz)")
    parser.add_argument("--rerun", type=Path, required=True, help="the logs tarball of the job that trained again")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stem", default=None, help="the report's file names (default: --logs's, less _logs.tar.gz)")
    args = parser.parse_args()
    stem = args.stem or (args.logs.name[: -len("_logs.tar.gz")] if args.logs.name.endswith("_logs.tar.gz") else None)
    if not stem:
        parser.error(f"--stem: {args.logs.name} does not end in _logs.tar.gz; name the report's files")
    with tempfile.TemporaryDirectory(prefix="extension-rerun-") as tmp:
        work, rerun_work = Path(tmp) / "report", Path(tmp) / "rerun"
        try:
            header, records = handoff.restore_state(args.logs, work)
            rerun_header, rerun_records = handoff.restore_state(args.rerun, rerun_work)
            join(work, header, records, rerun_work, rerun_header, rerun_records)
        except handoff.JobsError as exc:
            print(f"bench.extension.rerun: {exc}", file=sys.stderr)
            return 2
        handoff.save_state(work, header, records)  # the logs tarball resumes as the joined report
        write(args.out, work, stem, header, records, final=True, figures=True)
    print(f"bench.extension.rerun: {args.out / stem}.json, .md, figures and logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

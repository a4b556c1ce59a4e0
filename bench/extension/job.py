"""One device job of the extension experiment: its machine and versions, its work directory, the environment of its
subprocesses, its deadline, the record of each subprocess, and the report rewritten after each phase."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.extension import handoff, report
from bench.extension.scales import Scale
from bench.source_identity import source_identity

REPO = Path(__file__).resolve().parents[2]
# The jobs that train one model and hand it on, in parts, to later jobs
PARTS_PHASES = ("base", "dense", "sparse")


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


def environment(python: str, scale: str) -> dict[str, Any]:
    """GPU (nvidia-smi), versions (package metadata, no imports), source commit: cheap, at the start."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python_exe": python,
        "cpus": os.cpu_count(),
    }
    name, query = "", []
    if not scale.startswith("smoke") and shutil.which("nvidia-smi"):
        query = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
        if query:
            name, info["driver"] = [part.strip() for part in query[0].split(",")[:2]]
    info["gpu_name"] = name or "CPU"
    info["num_gpus"] = len(query)
    info["gpu"] = (
        "cpu"
        if not name
        else "h100"
        if "H100" in name
        else "h200"
        if "H200" in name
        else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    )
    versions = {}
    for package in ("torch", "triton", "transformers", "datasets", "tokenizers", "matplotlib"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "missing"
    info["versions"] = versions

    info.update(source_identity())
    return info


class Job:
    """Work directory, subprocess environment, deadline, records, and the report written after each phase."""

    def __init__(self, args: argparse.Namespace, scale: Scale):
        self.args, self.scale, self.phase = args, scale, args.phase
        self.out, self.work = Path(args.out).resolve(), Path(args.work).resolve()
        self.start = float(os.environ.get("EXP_START") or 0) or time.time()
        self.deadline = self.start + (args.budget or scale.budget_s)
        self.records: list[Record] = []
        self.running: dict[str, subprocess.Popen] = {}
        self.header: dict = {"scale": scale.name, "budget_s": args.budget or scale.budget_s, "notes": [], "jobs": []}
        self.env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            WANDB_MODE="disabled",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            HF_DATASETS_CACHE=str(self.work / "datasets_cache"),
            MPLBACKEND="Agg",
            COLUMNS="200",
            PYTHONPATH=os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        if scale.name.startswith("smoke"):
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    def left(self) -> float:
        return self.deadline - time.time()

    @property
    def num_gpus(self) -> int:
        return self.header.get("num_gpus", 0)

    @property
    def procs(self) -> int:
        """Training processes: the scale's, or one per GPU present."""
        return self.scale.procs or self.num_gpus

    @property
    def untagged_stem(self) -> str:
        """File names in OUT: the scale's report; a job that trains one model for later jobs (base, dense, sparse)
        appends its phase, and the jobs that end a scale (all, extend, eval) write the report of every job."""
        gpu = self.header.get("gpu", "cpu")
        device = "gpu" if self.num_gpus else "cpu"
        stem = self.scale.stem.format(gpu=gpu, procs=self.procs, device=device)
        return stem + (f"_{self.phase}" if self.phase in PARTS_PHASES else "")

    @property
    def stem(self) -> str:
        """The report's file names: untagged_stem, then --tag (a variants job: the tag of the variant running)."""
        return f"{self.untagged_stem}_{self.args.tag}" if self.args.tag else self.untagged_stem

    @property
    def parts_dir(self) -> Path | None:
        """OUT/<model>_parts: the export of the model this job trains, in parts, and the logs of every job so far.
        None for a job that trains no model for later jobs: an eval job, or a sparse job of several variants."""
        return self.out / f"{self.phase}_parts" if self.phase in PARTS_PHASES and not self.args.variants else None

    @property
    def variant_logs(self) -> Path:
        """A variants job's logs tarball of the variant running (what a one-variant job leaves in OUT), kept in
        the work directory until variants.py gathers them in one file of OUT."""
        return self.work / "variant_logs" / f"{self.stem}_logs.tar.gz"

    def mtrain(self, *args: str) -> list[str]:
        return [self.args.python, "-m", "mtrain_cli", *args]

    def torchrun(self, *args: str) -> list[str]:
        """`mtrain ...` under torchrun over this job's training processes (mtrain extend has --nproc instead)."""
        if self.procs <= 1:
            return self.mtrain(*args)
        launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.procs)]
        return [self.args.python, *launch, "-m", "mtrain_cli", *args]

    def add(self, rec: Record) -> None:
        """Records `rec`, in place of an earlier job's record of the same name (an eval it skipped, run now)."""
        self.records = [r for r in self.records if r.name != rec.name] + [rec]

    def launch(self, rec: Record, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        rec.command = shlex.join(cmd)
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{rec.name}.out", "w") as out, open(logs / f"{rec.name}.err", "w") as err:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env or self.env,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.running[rec.name] = proc
        rec.meta["started_s"] = round(time.time() - self.start, 1)
        rec.meta["job"] = self.phase
        print(f"[{rec.meta['started_s']:6.1f} s] {rec.name}: {rec.command}", flush=True)
        return proc

    def finish(self, rec: Record, rc: int | None, wall_s: float, stopped: str = "") -> None:
        self.running.pop(rec.name, None)
        rec.rc, rec.wall_s = rc, round(wall_s, 1)
        if stopped:
            rec.status, rec.reason = "skipped", stopped
        elif rc == 0:
            rec.status = "pass"
        else:
            err = (self.work / "logs" / f"{rec.name}.err").read_text(errors="replace").strip().splitlines()
            rec.status, rec.reason = "fail", f"exit code {rc}: " + (err[-1][:300] if err else "")
        print(
            f"[{time.time() - self.start:6.1f} s] {rec.name}: {rec.status} in {rec.wall_s} s {rec.reason}", flush=True
        )

    def run(self, rec: Record, cmd: list[str], timeout: float, env: dict | None = None) -> bool:
        """Runs to the end or to `timeout` (then stopped and recorded as over the budget). -> passed."""
        self.add(rec)
        started = time.time()
        proc = self.launch(rec, cmd, env)
        try:
            self.finish(rec, proc.wait(timeout=max(1.0, timeout)), time.time() - started)
        except subprocess.TimeoutExpired:
            stop(proc)
            self.finish(rec, None, time.time() - started, f"stopped at the time budget after {timeout:.0f} s")
        return rec.status == "pass"

    def fail(self, message: str) -> None:
        """A reason the job cannot go on: printed, and in the report's notes."""
        print(f"bench.extension: {message}", file=sys.stderr, flush=True)
        self.header["notes"].append(f"stopped: {message}")

    def write(self, final: bool = False) -> None:
        self.header.update(elapsed_s=round(time.time() - self.start, 1), complete=final)
        this_job = {
            key: self.header.get(key)
            for key in ("date_utc", "gpu_name", "procs", "git_commit", "src_sha256", "elapsed_s", "budget_s", "command")
        }
        self.header["jobs"] = [
            *[j for j in self.header["jobs"] if j["phase"] != self.phase],
            {"phase": self.phase, **this_job},
        ]
        records = [asdict(r) for r in self.records]
        handoff.save_state(self.work, self.header, records)
        parts = self.parts_dir  # a job's logs travel with its model's parts, once they exist
        bundle_to = parts / "logs.tar.gz" if parts is not None and parts.is_dir() else None
        if final and self.phase == "sparse" and self.args.variants:
            bundle_to = self.variant_logs
        report.write(
            self.out,
            self.work,
            self.stem,
            self.header,
            records,
            final,
            figures=final and self.phase not in PARTS_PHASES,  # OUT holds 8 files: the parts take 4 of them
            bundle_to=bundle_to,
        )

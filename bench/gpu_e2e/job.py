"""One run of the end-to-end flows: the record of each flow, what later flows take from earlier ones, the
subprocesses (each in its own process group, with its own logs and timeout) inside one time budget, and the results
rewritten after every flow."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.gpu_e2e.report import atomic_write, markdown
from bench.gpu_e2e.scales import Scale

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Record:
    name: str
    kind: str
    description: str
    command: str = ""
    rc: int | None = None
    status: str = "pending"  # pass | fail | skipped
    reason: str = ""  # why it failed or was skipped
    wall_s: float | None = None
    timeout_s: float | None = None
    timed_out: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # what was verified (pass) or found wrong (fail)
    stderr_tail: str = ""
    logs: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)  # run_dir, export, results ... (paths on the device)
    budget_skip: bool = False  # not run (or stopped) for lack of time, itself or a prerequisite: run it again


@dataclass
class Flow:
    """One user flow: `run` launches its commands with `job.run` and checks what they wrote into `rec`."""

    name: str
    kind: str  # the scale's timeout key
    description: str
    run: Callable[[Job, Record], None]
    deps: tuple[str, ...] = ()  # flows that must pass first (added to a --flows selection)
    min_s: float = 20.0  # skip when less than this is left of the budget


@dataclass
class State:
    """What later flows take from earlier ones, filled as flows pass."""

    data: dict[str, Path] = field(default_factory=dict)  # training and eval files (data.py's make_data)
    run_dirs: dict[str, Path] = field(default_factory=dict)  # flow name -> the run directory it trained and checked
    models: dict[str, Path] = field(default_factory=dict)  # flow name -> a model directory it made (--model input)
    resume_interrupted_at: int | None = None  # the last step logged before resume-interrupt's Ctrl-C


class Job:
    """Work directory, environment of the subprocesses, time budget, and the results on disk."""

    def __init__(self, args: argparse.Namespace, scale: Scale):
        self.args, self.scale = args, scale
        self.out = Path(args.out).resolve()
        self.work = Path(args.work or f"/tmp/gpu_e2e_{scale.name}").resolve()
        start = float(os.environ.get("E2E_START", "0") or 0) or time.time()
        self.start = start
        self.deadline = start + (args.budget if args.budget is not None else scale.budget_s)
        self.records: list[Record] = []
        self.header: dict[str, Any] = {}
        self.tag = "cpu"
        self.current: subprocess.Popen | None = None
        self.state = State()
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        parts = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        src = str(REPO / "src")
        if src not in parts:
            parts.append(src)
        env.update(
            PYTHONPATH=os.pathsep.join(parts),
            PYTHONUNBUFFERED="1",
            WANDB_MODE="disabled",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            COLUMNS="240",
            HF_DATASETS_CACHE=str(self.work / "datasets_cache"),
            TOKENIZERS_PARALLELISM="false",
        )
        if self.scale.name == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def left(self) -> float:
        return self.deadline - time.time()

    def mtrain(self, *args: str) -> list[str]:
        return [self.args.python, "-m", "mtrain_cli", *args]

    def out_dir(self, group: str, name: str) -> Path:
        """WORK/<group>/<name>, empty: where a flow's command writes."""
        path = self.work / group / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    # -- running ---------------------------------------------------------------------------------------
    def run(
        self,
        rec: Record,
        cmd: list[str],
        timeout: float,
        log_name: str | None = None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int | None:
        """Runs cmd in its own process group; stdout and stderr to logs/<name>.{out,err}. -> rc (None: killed)."""
        name = log_name or rec.name
        out_path, err_path = self.work / "logs" / f"{name}.out", self.work / "logs" / f"{name}.err"
        rec.command = (rec.command + "\n" if rec.command else "") + shlex.join(cmd)
        rec.logs += [str(out_path.relative_to(self.work)), str(err_path.relative_to(self.work))]
        rec.timeout_s = round(timeout, 1)
        t0 = time.time()
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=self.env,
                stdout=out_f,
                stderr=err_f,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.current = proc
            try:
                if on_start is not None:
                    on_start(proc)
                rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                rec.timed_out = True
                kill_group(proc)
                rc = None
            finally:
                self.current = None
        rec.wall_s = round((rec.wall_s or 0.0) + time.time() - t0, 2)
        rec.rc = rc
        rec.stderr_tail = tail(err_path, 25) or tail(out_path, 25)
        return rc

    # -- results -----------------------------------------------------------------------------------------
    def write(self, final: bool = False) -> None:
        counts = {s: sum(r.status == s for r in self.records) for s in ("pass", "fail", "skipped", "pending")}
        rerun = [r.name for r in self.records if r.budget_skip]
        payload = {
            **self.header,
            "elapsed_s": round(time.time() - self.start, 1),
            "rerun_flows": rerun,
            "budget_s": round(self.deadline - self.start),
            "complete": final,
            "counts": counts,
            "flows": [asdict(r) for r in self.records],
        }
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"gpu_e2e_{self.tag}"
        atomic_write(stem.with_suffix(".json"), json.dumps(payload, indent=2, default=str) + "\n")
        atomic_write(stem.with_suffix(".md"), markdown(payload))
        self._bundle(self.out / f"gpu_e2e_{self.tag}_logs.tar.gz")

    def _bundle(self, path: Path) -> None:
        """Logs and the small files the runs wrote (no checkpoints, no weights), one tar.gz."""
        keep_names = {
            "config.yaml",
            "summary.json",
            "metrics.jsonl",
            "results.json",
            "summary.md",
            "config.json",
            "predictions.jsonl",
            "niah.csv",
            "pg19.csv",
            "generation_config.json",
        }
        files: list[Path] = []
        for sub in ("logs", "runs", "evals", "profile"):
            root = self.work / sub
            if not root.is_dir():
                continue
            for p in sorted(root.rglob("*")):
                if not p.is_file() or "checkpoints" in p.parts:
                    continue
                if sub in ("logs", "profile") or p.name in keep_names or p.suffix == ".csv":
                    if p.stat().st_size <= 8 * 2**20:
                        files.append(p)
        for extra in ("e2e.yaml", "data/manifest.json"):
            if (self.work / extra).is_file():
                files.append(self.work / extra)
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=f"gpu_e2e_{self.tag}/{p.relative_to(self.work)}")
        os.replace(tmp, path)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this script started for `proc`."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int) -> str:
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").rstrip()
    return "\n".join(text.splitlines()[-lines:])

"""What the machine and the interpreter that runs the flows have: GPU, driver, versions, and each import the flows
need, checked apart (a missing one is named with the flows it costs) in a subprocess of that interpreter."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import datetime, timezone
from typing import Any

from bench.gpu_e2e.job import REPO, Job
from bench.source_identity import source_identity

ENV_PROBE = r"""
import importlib, json, sys
out = {"python": sys.version.split()[0], "imports": {}}
for name in ("mtrain_cli.cli", "torch", "triton", "transformers", "datasets", "tokenizers", "safetensors",
             "typer", "rich", "yaml", "pyarrow", "matplotlib", "wandb"):
    try:
        module = importlib.import_module(name)
        out["imports"][name] = getattr(module, "__version__", "ok")
    except Exception as exc:
        out["imports"][name] = f"MISSING: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
try:
    import torch
    out["cuda_available"] = torch.cuda.is_available()
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(0)
        out["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    out["cpu_threads"] = torch.get_num_threads()
except Exception as exc:
    out["cuda_available"] = f"error: {exc}"
print(json.dumps(out))
"""

# What a missing import costs: the flows that need it (matplotlib: eval plots; wandb: logging.wandb only).
IMPORT_NEEDS = {
    "mtrain_cli.cli": "every flow",
    "torch": "every flow",
    "transformers": "every flow",
    "tokenizers": "every flow",
    "safetensors": "every flow",
    "typer": "every flow (the CLI)",
    "rich": "every flow (the CLI)",
    "datasets": "extend and profile step (tokenisation)",
    "yaml": "every flow (recipes)",
    "matplotlib": "eval (NIAH heatmap, PG-19 curve)",
    "pyarrow": "extend (datasets)",
    "wandb": "only logging.wandb=true, which these flows do not use",
    "triton": "sparse attention on GPU, profile kernels",
}


def environment(job: Job) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "scale": job.scale.name,
        "python_exe": job.args.python,
        "repo": str(REPO),
        "work_dir": str(job.work),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    smi = shutil.which("nvidia-smi")
    if smi and job.scale.name != "cpu":
        try:
            line = (
                subprocess.run(
                    [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            name, driver, memory = [x.strip() for x in line.split(",")]
            info.update(
                gpu_name=name,
                driver=driver,
                gpu_memory=memory,
                gpu_count=len(
                    subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
                ),
            )
        except (subprocess.SubprocessError, IndexError, ValueError) as exc:
            info["nvidia_smi_error"] = str(exc)
    name = info.get("gpu_name", "")
    job.tag = (
        "cpu"
        if job.scale.name == "cpu"
        else "h100"
        if "H100" in name
        else "h200"
        if "H200" in name
        else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"
    )
    info["gpu"] = job.tag
    try:
        probe = subprocess.run(
            [job.args.python, "-c", ENV_PROBE], capture_output=True, text=True, timeout=180, env=job.env, cwd=REPO
        )
        info.update(json.loads(probe.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as exc:
        info["env_probe_error"] = f"{exc}; stderr: {getattr(exc, 'stderr', '') or ''}"[-2000:]
    missing = {k: v for k, v in info.get("imports", {}).items() if str(v).startswith("MISSING")}
    info["missing_imports"] = {k: f"{v} (needed by: {IMPORT_NEEDS.get(k, '?')})" for k, v in missing.items()}
    info["source"] = source_identity()
    return info

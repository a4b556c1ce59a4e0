"""launch.leave_launched_rank: a rank of a launch leaves at once with its output flushed; one process returns.
`accelerate launch -m mtrain_cli extend` starts the ranks as torchrun does (a 2-rank gloo run from an accelerate
config file trains exactly as `--nproc 2`); accelerate settings mtrain cannot honour are one line, those it
does not apply are named in one warning kept in the summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from spawned_ranks import run_cli_ranks
from tiny_setup import cli_env, only_run_dir, set_args, small_run, step_losses

from mtrain_cli.cli import launch
from mtrain_cli.cli.launch import RANK_SHUTDOWN_S, accelerate_settings, torchrun_command
from mtrain_cli.errors import UserError
from mtrain_cli.train import stops

SCRIPT = """
import atexit
from mtrain_cli.cli.launch import leave_launched_rank
atexit.register(lambda: print("teardown ran"))
print("written before leaving", end="")
leave_launched_rank()
print(" - returned")
"""


def run(world_size: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_a_launched_rank_leaves_with_its_output_flushed_and_no_teardown():
    done = run("2")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "written before leaving"  # flushed, then nothing after: neither the return nor atexit


def test_one_process_returns_and_tears_down_as_usual():
    for world_size in (None, "1"):
        done = run(world_size)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "written before leaving - returned\nteardown ran\n"


def test_accelerate_settings_are_applied_refused_or_named():
    assert accelerate_settings({"PATH": "/bin"}) == ([], [])
    launched = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_BACKEND": "NO", "WORLD_SIZE": "2"}
    assert accelerate_settings(launched) == (["train.dtype=bf16"], [])
    overrides, (warning,) = accelerate_settings(
        {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_USE_FSDP": "true"}
    )
    assert overrides == [] and warning.startswith("accelerate launch: not applied, the recipe decides instead: ")
    assert "mixed_precision no (train.dtype auto" in warning and "dynamo_backend INDUCTOR (train.compile)" in warning
    assert "FSDP settings (mtrain applies FSDP2" in warning
    cpu_rank = {"ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "bf16", "WORLD_SIZE": "2"}
    assert accelerate_settings(cpu_rank)[0] == ["train.device=cpu", "train.dtype=bf16"]
    refused = [
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, "accelerate launch with DeepSpeed: mtrain shards the model itself"),
        ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "accelerate launch with Megatron-LM"),
        ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "accelerate launch --mixed_precision fp16: mtrain trains with bf16"),
        ({"ACCELERATE_USE_CPU": "True", "MASTER_PORT": "29500"}, "accelerate launch --cpu --num_processes N started"),
    ]
    for environ, message in refused:
        with pytest.raises(UserError, match="^" + message.replace("(", r"\(")):
            accelerate_settings(environ)


def test_accelerate_launch_trains_as_torchrun_does(tmp_path):
    """`accelerate launch --config_file` (MULTI_GPU, 2 processes: on a CPU machine they are gloo ranks) runs the
    same 2-rank job as the ranks of `mtrain extend --nproc 2` (forked with torchrun's environment: torchrun's own
    launch is tested in tests/test_run_stops.py); `--cpu --num_processes 2` (one process) is one line."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate is not None, "accelerate is a dependency: its console script is installed beside python"
    config_file = tmp_path / "accelerate.yaml"
    config_file.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n"
        "machine_rank: 0\nmixed_precision: 'no'\nuse_cpu: false\ngpu_ids: all\nmain_training_function: main\n"
    )
    overrides = [o for o in small_run(2, tmp_path) if not o.startswith("run.output_dir")]
    args = set_args([*overrides, "parallel.dp=2", "train.grad_clip=0"])
    launched = subprocess.run(
        [accelerate, "launch", "--config_file", str(config_file), "-m", "mtrain_cli", "extend", *args]
        + ["--output-dir", str(tmp_path / "accelerate")],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    torchrun = run_cli_ranks(2, "extend", *args, "--output-dir", str(tmp_path / "torchrun"))
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    runs = {name: only_run_dir(tmp_path / name) for name in ("accelerate", "torchrun")}
    summaries = {name: json.loads((run / "summary.json").read_text()) for name, run in runs.items()}
    assert summaries["accelerate"]["parallel"] == summaries["torchrun"]["parallel"]
    assert summaries["accelerate"]["parallel"]["world"] == 2
    assert step_losses(runs["accelerate"]) == step_losses(runs["torchrun"])
    (warning,) = summaries["accelerate"]["warnings"]
    assert warning.startswith("accelerate launch: not applied, the recipe decides instead: mixed_precision no")
    assert summaries["torchrun"]["warnings"] == []

    one = subprocess.run(
        [accelerate, "launch", "--cpu", "--num_processes", "2", "-m", "mtrain_cli", "extend", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=600,
    )
    (line,) = [line for line in one.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: accelerate launch --cpu --num_processes N started one process")


def test_nproc_gives_the_ranks_time_to_save_before_torchrun_kills_them():
    command, env = torchrun_command(["extend", "--nproc", "4", "--recipe", "tiny", "--nproc=4"], 4, {"PATH": "/bin"})
    assert command[command.index("--nproc-per-node") + 1] == "4"
    assert command[-3:] == ["extend", "--recipe", "tiny"]
    assert env == {"PATH": "/bin", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(RANK_SHUTDOWN_S)}
    assert RANK_SHUTDOWN_S > 30  # torchrun's default
    _, env = torchrun_command(["extend"], 2, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"})
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "60"  # the user's choice stands


def test_the_launcher_hands_on_exactly_the_signals_the_ranks_save_for():
    assert launch.STOP_SIGNALS == stops.STOP_SIGNALS

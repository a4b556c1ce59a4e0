"""Tests that run as several processes: each rank's traceback is written where the parent reads it, so a failing
rank fails the test with its reason instead of leaving the others waiting in a collective silently.

The ranks are forked from a forkserver that imported torch, transformers and the trainer once (per pytest
worker): a spawned rank spent most of its time importing them again (5-7 CPU-s each, ~60 ranks a suite). Each
rank is still a process of its own, with its own process group, threads and monkeypatches. The forkserver
starts on the first launch, with this process's environment (tests/conftest.py's settings, TRITON_INTERPRET)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_setup import cli_env

# imported once in the forkserver, before it forks any rank: what the ranks of every launch import
mp.set_forkserver_preload(
    ["torch", "torch.distributed", "transformers", "mtrain_cli.train.loop", "mtrain_cli.train.run", "mtrain_cli.cli"]
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, worker: Callable, world: int, port: int, args: tuple, error_dir: str) -> None:
    try:
        worker(rank, world, port, *args)
    except Exception:
        (Path(error_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def launch(fn: Callable, world: int, *args) -> None:
    """fn(rank, *args) on `world` processes forked from the preloaded forkserver; raises if a rank failed."""
    mp.start_processes(fn, args=args, nprocs=world, start_method="forkserver")


def run_ranks(worker: Callable, world: int, *args, error_dir: Path) -> None:
    """worker(rank, world, port, *args) on `world` processes (port: a free one for the process group); one pytest
    failure with every failed rank's traceback."""
    try:
        launch(_rank, world, worker, world, free_port(), args, str(error_dir))
    except Exception as exc:
        reports = "\n".join(p.read_text() for p in sorted(Path(error_dir).glob("rank*.txt")))
        pytest.fail(f"{exc}\n{reports}")


def _cli_rank(rank: int, world: int, port: int, args: tuple[str, ...], output_dir: str) -> None:
    """One rank of `mtrain --nproc N ARGS` as torchrun starts it: its environment, `mtrain ARGS` without --nproc
    (torchrun_command), its stdout and stderr in files of output_dir; the exit code the command's."""
    from mtrain_cli.cli import main

    os.environ.clear()
    os.environ.update(
        cli_env(),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a rank that torchrun starts (torch is loaded here)
    for fd, name in ((1, "out"), (2, "err")):
        with open(Path(output_dir) / f"rank{rank}.{name}", "w") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = ["mtrain", *args]
    main()


def run_cli_ranks(world: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mtrain --nproc N ARGS` with its N ranks forked from the preloaded forkserver instead of started by torchrun
    (each would import torch, transformers and the trainer again): for tests of the run, not of the launch
    (tests/test_launch.py and tests/test_run_stops.py run torchrun). Exit code: the first failed rank's, else 0;
    stdout and stderr: every rank's, in rank order (torchrun's ranks write to the launch's own)."""
    with tempfile.TemporaryDirectory() as output_dir:
        port, deadline = free_port(), time.monotonic() + timeout
        context = mp.get_context("forkserver")
        ranks = [context.Process(target=_cli_rank, args=(rank, world, port, args, output_dir)) for rank in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # past the timeout, as subprocess.run would stop it
                process.kill()
                process.join()
        code = next((process.exitcode for process in ranks if process.exitcode != 0), 0)
        outputs = {
            name: "".join(p.read_text() for p in sorted(Path(output_dir).glob(f"rank*.{name}")))
            for name in ("out", "err")
        }
        return subprocess.CompletedProcess(["mtrain", *args], code, outputs["out"], outputs["err"])

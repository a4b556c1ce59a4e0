"""Tests that run as several processes: each rank's traceback is written where the parent reads it, so a failing
rank fails the test with its reason instead of leaving the others waiting in a collective silently.

The ranks are forked from a forkserver that imported torch, transformers and the trainer once (per pytest
worker): a spawned rank spent most of its time importing them again (5-7 CPU-s each, ~60 ranks a suite). Each
rank is still a process of its own, with its own process group, threads and monkeypatches. The forkserver
starts on the first launch, with this process's environment (tests/conftest.py's settings, TRITON_INTERPRET)."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

# imported once in the forkserver, before it forks any rank: what the ranks of every launch import
mp.set_forkserver_preload(
    ["torch", "torch.distributed", "transformers", "mtrain_cli.train.loop", "mtrain_cli.train.run"]
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

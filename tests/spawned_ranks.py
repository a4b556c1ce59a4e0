"""Tests that run as several processes (`mp.spawn`): each rank's traceback is written where the parent reads it, so
a failing rank fails the test with its reason instead of leaving the others waiting in a collective silently."""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


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


def run_ranks(worker: Callable, world: int, *args, error_dir: Path) -> None:
    """worker(rank, world, port, *args) on `world` processes (port: a free one for the process group); one pytest
    failure with every failed rank's traceback."""
    try:
        mp.spawn(_rank, args=(worker, world, free_port(), args, str(error_dir)), nprocs=world)
    except Exception as exc:
        reports = "\n".join(p.read_text() for p in sorted(Path(error_dir).glob("rank*.txt")))
        pytest.fail(f"{exc}\n{reports}")

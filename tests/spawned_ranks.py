"""Tests that run as several processes: each rank's traceback is written where the parent reads it, so a failing
rank fails the test with its reason instead of leaving the others waiting in a collective silently.

The ranks are forked from a forkserver that imported torch, transformers and the trainer once (per pytest
worker): a spawned rank spent most of its time importing them again (5-7 CPU-s each, ~60 ranks a suite). Each
rank is still a process of its own, with its own process group, threads and monkeypatches. The forkserver
starts on the first launch, with this process's environment (tests/conftest.py's settings, TRITON_INTERPRET)."""

from __future__ import annotations

import gc
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny_setup import cli_env

# imported once in the forkserver, before it forks any rank: what the ranks of every launch import. The CLI first,
# as in a command's own process: piped, it turns datasets' and transformers' progress bars off before they load.
mp.set_forkserver_preload(
    ["mtrain_cli.cli", "torch", "torch.distributed", "transformers", "mtrain_cli.train.loop", "mtrain_cli.train.run"]
)


# Below Linux's ephemeral range (32768-60999): a port the OS handed out for binding to 0 can be taken, before the
# process group listens on it, by a connection of another test's ranks (gloo connects from ephemeral ports)
PORTS = range(20000, 32768)


def free_port() -> int:
    """A port for a process group's store, free when chosen, outside the range outgoing connections take theirs from."""
    while True:
        port = random.SystemRandom().choice(PORTS)  # not the tests' seeded generator: workers would agree
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def _rank(rank: int, worker: Callable, world: int, port: int, args: tuple, error_dir: str) -> None:
    try:
        worker(rank, world, port, *args)
    except Exception:
        (Path(error_dir) / f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _freeze_preloaded() -> None:
    """In a forked process: what the forkserver imported is never garbage. Frozen, a full collection (each case's
    in a launch, train.distributed.end_parallel's) scans only what the process made since, not every module's
    objects (0.3-0.5 s a collection)."""
    gc.freeze()


def _forked(rank: int, fn: Callable, *args) -> None:
    _freeze_preloaded()
    fn(rank, *args)


def launch(fn: Callable, world: int, *args) -> None:
    """fn(rank, *args) on `world` processes forked from the preloaded forkserver; raises if a rank failed."""
    mp.start_processes(_forked, args=(fn, *args), nprocs=world, start_method="forkserver")


def run_ranks(worker: Callable, world: int, *args, error_dir: Path) -> None:
    """worker(rank, world, port, *args) on `world` processes (port: a free one for the process group); one pytest
    failure with every failed rank's traceback."""
    try:
        launch(_rank, world, worker, world, free_port(), args, str(error_dir))
    except Exception as exc:
        reports = "\n".join(p.read_text() for p in sorted(Path(error_dir).glob("rank*.txt")))
        pytest.fail(f"{exc}\n{reports}")


def _cli_main(args: tuple[str, ...], environ: dict[str, str], output_stem: str) -> None:
    """`mtrain ARGS` as a new process runs it: `environ` for its environment, its stdout and stderr in the files
    OUTPUT_STEM.out and .err; the exit code the command's."""
    from mtrain_cli.cli import main

    _freeze_preloaded()
    os.environ.clear()
    os.environ.update(environ)
    if "OMP_NUM_THREADS" in environ:  # read when torch loaded, in the forkserver
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    for fd, suffix in ((1, "out"), (2, "err")):
        with open(f"{output_stem}.{suffix}", "w") as file:
            os.dup2(file.fileno(), fd)
    sys.argv = ["mtrain", *args]
    main()


class CLIRuns:
    """Processes of `mtrain ARGS`, one per environment, forked from the preloaded forkserver instead of started
    afresh (each would import torch, transformers and the trainer again). They start at once; `finish` waits for
    them, `kill` ends them as SIGKILL to a launch does."""

    def __init__(self, args: tuple[str, ...], environs: list[dict[str, str]]):
        self.args, self.output_dir = args, tempfile.mkdtemp()
        context = mp.get_context("forkserver")
        self.processes = [
            context.Process(target=_cli_main, args=(args, environ, f"{self.output_dir}/rank{rank}"))
            for rank, environ in enumerate(environs)
        ]
        for process in self.processes:
            process.start()

    def kill(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.join()
        shutil.rmtree(self.output_dir)

    def finish(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """Exit code: the first failed process's, else 0; stdout and stderr: every process's, in rank order
        (torchrun's ranks write to the launch's own)."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # past the timeout, as subprocess.run would stop it
                process.kill()
                process.join()
        code = next((process.exitcode for process in self.processes if process.exitcode != 0), 0)
        outputs = {
            name: "".join(p.read_text() for p in sorted(Path(self.output_dir).glob(f"rank*.{name}")))
            for name in ("out", "err")
        }
        shutil.rmtree(self.output_dir)
        return subprocess.CompletedProcess(["mtrain", *self.args], code, outputs["out"], outputs["err"])


class CLIRanks(CLIRuns):
    """The ranks of `mtrain --nproc N ARGS` as torchrun starts them (its environment, `mtrain ARGS` without --nproc:
    torchrun_command), forked: for tests of the run, not of the launch (tests/test_run_stops.py runs torchrun,
    tests/test_launch.py accelerate launch)."""

    def __init__(self, world: int, *args: str):
        port = free_port()
        environs = [
            dict(
                cli_env(),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",  # one intra-op thread a rank, as torchrun gives
            )
            for rank in range(world)
        ]
        super().__init__(args, environs)


def run_cli_ranks(world: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mtrain --nproc N ARGS` on N ranks forked from the preloaded forkserver (CLIRanks), to its end."""
    return CLIRanks(world, *args).finish(timeout)


def run_forked_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mtrain ARGS` in a process of its own forked from the preloaded forkserver, to its end: what
    subprocess.run(capture_output=True, env=env) of a new process gives (env: its whole environment, cli_env() if
    None), without importing torch, transformers and the trainer again. The command's imports and start are
    tested in new processes elsewhere (tests/test_cli_errors.py, tests/test_first_run.py)."""
    return CLIRuns(args, [cli_env() if env is None else env]).finish(timeout)


def _cli_process(args: tuple[str, ...], env: dict[str, str], output, ignore_sigint: bool) -> None:
    """`mtrain ARGS` as subprocess.Popen(start_new_session=True, stdout=PIPE, stderr=STDOUT) starts it: a session of
    its own, `env` for its environment, stdout and stderr on the pipe `output`, line by line as a fresh process
    under PYTHONUNBUFFERED writes them."""
    from mtrain_cli.cli import main

    _freeze_preloaded()
    os.setsid()
    if ignore_sigint:  # what a background job of a script inherits
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # read when torch loaded, in the forkserver
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd in (1, 2):
        os.dup2(output.fileno(), fd)
    output.close()
    sys.stdout.reconfigure(line_buffering=True)
    sys.argv = ["mtrain", *args]
    main()


class ForkedCLI:
    """`mtrain ARGS` in a process of its own, forked from the preloaded forkserver: for tests that signal or kill a
    run (its own pid, session, signal handlers and exit code: -N when signal N killed it), without importing torch,
    transformers and the trainer again (5-7 CPU-s a process). What the tests use of subprocess.Popen(...,
    stdout=PIPE, stderr=STDOUT, text=True): pid, stdout, poll, send_signal, communicate, returncode. The command's
    imports and start are tested in fresh processes elsewhere (tests/test_cli_errors.py, tests/test_first_run.py)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, ignore_sigint: bool = False):
        context = mp.get_context("forkserver")
        read, write = context.Pipe(duplex=False)
        environ = {**cli_env(), **(env or {})}
        self._process = context.Process(target=_cli_process, args=(args, environ, write, ignore_sigint))
        self._process.start()
        write.close()
        self.pid, self.returncode = self._process.pid, None
        self.stdout = open(os.dup(read.fileno()), encoding="utf-8", errors="replace")  # noqa: SIM115 (as Popen's)
        read.close()

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The rest of the output, once the process has closed it (it exits), as Popen.communicate."""
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(["mtrain"], timeout)
        self._process.join()
        self.stdout.close()
        self.poll()
        return rest[0], None

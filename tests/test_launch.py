"""launch.leave_launched_rank: a rank of a launch leaves at once with its output flushed; one process returns."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import atexit
from mtrain_cli.launch import leave_launched_rank
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

"""`mtrain extend --nproc N`: re-run the same command under torchrun on this machine; how a launched rank leaves.

torchrun (`torch.distributed.run --standalone`) starts N copies with RANK/WORLD_SIZE/LOCAL_RANK set and a
local rendezvous; each copy sees WORLD_SIZE and runs normally. Multi-node launches use torchrun directly
with its own --nnodes/--rdzv-* flags; mtrain then just runs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys


def relaunch_under_torchrun(nproc: int) -> int:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node N -m mtrain_cli <args without --nproc>`."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        args.append(arg)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "mtrain_cli",
        *args,
    ]
    try:
        return subprocess.run(command).returncode
    except KeyboardInterrupt:  # torchrun forwards the signal to the ranks, which checkpoint and exit
        return 130


def leave_launched_rank() -> None:
    """A rank of a launch (WORLD_SIZE > 1) that finished its command leaves without interpreter teardown; a
    single process returns. Gloo's worker threads can still hold work whose tensors are freed during
    finalisation, which aborts a rank after a run that succeeded (SIGABRT, "terminate called without an
    active exception"; pytorch/pytorch#179291 describes the mechanism). Collecting the trainer before
    destroying the process groups (parallel.context.end_parallel) made it rare, not impossible: CI met it
    again on a resumed 2-rank run. By now every file is written and the groups are destroyed; what is left
    is to flush output."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)

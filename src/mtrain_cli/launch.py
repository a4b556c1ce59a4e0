"""`mtrain extend --nproc N`: re-run the same command under torchrun on this machine; how a launched rank leaves.

torchrun (`torch.distributed.run --standalone`) starts N copies with RANK/WORLD_SIZE/LOCAL_RANK set and a
local rendezvous; each copy sees WORLD_SIZE and runs normally. Multi-node launches use torchrun directly
with its own --nnodes/--rdzv-* flags; mtrain then just runs.
"""

from __future__ import annotations

import logging
import os
import signal
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
        "--signals-to-handle",  # torchrun passes these on to the ranks (SIGUSR1 would end it otherwise)
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "-m",
        "mtrain_cli",
        *args,
    ]
    launched = subprocess.Popen(command)
    received: list[int] = []

    def pass_on(signum, _frame):  # a scheduler's stop signal sent to this process alone reaches the ranks
        received.append(signum)
        if launched.poll() is None and len(received) == 1:
            launched.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, pass_on)
    try:
        code = launched.wait()
    except KeyboardInterrupt:  # torchrun forwards the signal to the ranks, which checkpoint and exit
        return 130
    return 128 + received[0] if received and code != 0 else code  # the ranks' code, not torchrun's 1


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

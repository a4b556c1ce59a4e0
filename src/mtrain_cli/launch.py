"""`mtrain extend --nproc N`: re-run the same command under torchrun on this machine.

torchrun (`torch.distributed.run --standalone`) starts N copies with RANK/WORLD_SIZE/LOCAL_RANK set and a
local rendezvous; each copy sees WORLD_SIZE and runs normally. Multi-node launches use torchrun directly
with its own --nnodes/--rdzv-* flags; mtrain then just runs.
"""

from __future__ import annotations

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

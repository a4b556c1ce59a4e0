"""`mtrain extend --nproc N`: re-run the same command under torchrun on this machine; what `accelerate launch`
settings mean for a run; how a launched rank leaves.

torchrun (`torch.distributed.run --standalone`) starts N copies with RANK/WORLD_SIZE/LOCAL_RANK set and a
local rendezvous; each copy sees WORLD_SIZE and runs normally. Multi-node launches use torchrun directly
with its own --nnodes/--rdzv-* flags; mtrain then just runs. `accelerate launch -m mtrain_cli extend ...`
(one process per GPU, multi-node from an `accelerate config` file) starts the copies through torchrun too;
its settings arrive as ACCELERATE_* variables, and mtrain says which of them it cannot apply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mtrain_cli.errors import UserError

# torchrun sends SIGKILL this long after passing a stop signal on (its default is 30 s): the ranks finish their
# step and save a checkpoint first, which for a multi-billion-parameter model takes minutes
RANK_SHUTDOWN_S = 900
# what the ranks handle by saving a checkpoint and exiting (train.stops.STOP_SIGNALS)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def torchrun_command(argv: list[str], nproc: int, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m mtrain_cli <argv without --nproc>` and
    its environment: the user's, with torchrun's shutdown grace raised to RANK_SHUTDOWN_S unless already set."""
    args, skip = [], False
    for arg in argv:
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
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(RANK_SHUTDOWN_S), **environ}
    return command, env


def launched_ranks(torchrun_pid: int) -> list[int]:
    """The processes torchrun started (its children, read from Linux's /proc); [] where there is no /proc or
    before torchrun has started them."""
    pids = []
    for children in Path(f"/proc/{torchrun_pid}/task").glob("*/children"):
        try:
            pids += [int(pid) for pid in children.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return pids


def relaunch_under_torchrun(nproc: int) -> int:
    """Run this command again under torchrun with N ranks (torchrun_command) and hand stop signals to the ranks.

    torchrun SIGKILLs its ranks a grace period after it receives a stop signal itself: 30 s, fixed before torch
    2.12, less than a large model's step and checkpoint. So torchrun runs in a session of its own, out of reach
    of the terminal's Ctrl-C, and this process passes Ctrl-C, SIGTERM and SIGUSR1 to the ranks directly; they
    agree on a step, save and exit, and torchrun ends with them. Without /proc, or before the ranks exist, the
    signal goes to torchrun (which passes it on within its grace). SIGHUP and SIGQUIT go to torchrun."""
    command, env = torchrun_command(sys.argv[1:], nproc, os.environ)
    launched = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def hand_on(signum, _frame):
        received.append(signum)
        if launched.poll() is not None:
            return
        ranks = launched_ranks(launched.pid) if signum in STOP_SIGNALS else []
        for pid in ranks or [launched.pid]:
            with contextlib.suppress(ProcessLookupError):  # a rank that already left
                os.kill(pid, signum)

    for signum in (*STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, hand_on)
    code = launched.wait()
    return 128 + received[0] if received and code != 0 else code  # the ranks' code, not torchrun's 1


def leave_launched_rank() -> None:
    """A rank of a launch (WORLD_SIZE > 1) that finished its command leaves without interpreter teardown; a
    single process returns. Gloo's worker threads can still hold work whose tensors are freed during
    finalisation, which aborts a rank after a run that succeeded (SIGABRT, "terminate called without an
    active exception"; pytorch/pytorch#179291 describes the mechanism). Collecting the trainer before
    destroying the process groups (train.distributed.end_parallel) made it rare, not impossible: CI met it
    again on a resumed 2-rank run. By now every file is written and the groups are destroyed; what is left
    is to flush output."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def accelerate_settings(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """What the settings of an `accelerate launch` (its ACCELERATE_* variables) mean for a run: (recipe overrides
    they imply, one-line warnings naming those mtrain does not apply). Settings it cannot honour raise UserError.
    Outside accelerate: ([], [])."""
    if not any(key.startswith("ACCELERATE_") for key in environ):
        return [], []
    on = {key for key, value in environ.items() if key.startswith("ACCELERATE_") and value.lower() == "true"}
    if "ACCELERATE_USE_DEEPSPEED" in on or "ACCELERATE_USE_MEGATRON_LM" in on:
        engine = "DeepSpeed" if "ACCELERATE_USE_DEEPSPEED" in on else "Megatron-LM"
        raise UserError(
            f"accelerate launch with {engine}: mtrain shards the model itself (FSDP2 over parallel.dp × "
            f"parallel.cp) and cannot run under {engine}; set distributed_type: MULTI_GPU in the accelerate config"
        )
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("no", "bf16"):
        raise UserError(
            f"accelerate launch --mixed_precision {precision}: mtrain trains with bf16 autocast on GPUs and in fp32 "
            f"on CPUs (train.dtype); set mixed_precision to bf16 or no in the accelerate config"
        )
    if "ACCELERATE_USE_CPU" in on and "WORLD_SIZE" not in environ and "MASTER_PORT" in environ:
        # accelerate's --cpu launcher starts one process and sets MASTER_PORT when more were asked for: several
        # CPU processes need mpirun, which it leaves to the user
        raise UserError(
            "accelerate launch --cpu --num_processes N started one process (accelerate runs several CPU "
            "processes only under mpirun); use accelerate launch --multi_gpu --num_processes N, which starts "
            "them through torchrun on CPUs too, or mtrain extend --nproc N"
        )
    overrides = ["train.device=cpu"] if "ACCELERATE_USE_CPU" in on else []
    overrides += ["train.dtype=bf16"] if precision == "bf16" else []
    ignored = []
    if precision == "no":  # also accelerate's value when nothing was configured
        ignored.append("mixed_precision no (train.dtype auto: bf16 autocast on GPUs, fp32 on CPUs)")
    if environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no":
        ignored.append(f"dynamo_backend {environ['ACCELERATE_DYNAMO_BACKEND']} (train.compile)")
    if "ACCELERATE_USE_FSDP" in on:
        ignored.append("its FSDP settings (mtrain applies FSDP2 over parallel.dp × parallel.cp itself)")
    if environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1") != "1":
        steps = environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]
        ignored.append(f"gradient_accumulation_steps {steps} (train.grad_accum)")
    warnings = [f"accelerate launch: not applied, the recipe decides instead: {'; '.join(ignored)}"] if ignored else []
    return overrides, warnings

"""Building the sparse kernels ahead, in parallel worker processes, while the trainer loads its data and model.

Triton builds a kernel on its first call, and the autotuner builds every config it tries, one after another in the
calling process: on a fresh machine the first sparse step built about ten kernels (probe partials and mass, forward,
delta, dQ, block dK/dV, four vertical configs, fold) for 15-17 s, where a dense step took 3 s. Built kernels go to
Triton's on-disk cache (TRITON_CACHE_DIR), keyed by source, GPU target and the arguments' specialization, so a
build made in another process of the same machine is a cache load (milliseconds) in this one.

So the trainer starts `num_workers` processes (`start_prebuild`), each of which runs one small sparse forward and
backward of the run's head shape, dtype and attention settings on the GPU (the same code path as training, at a
short length, so the kernels are specialized as the run's are), building only its share of the work: the units
(kernel, autotune config) are dealt round-robin (`deal_units`); a worker's autotuners keep only their own configs,
and a kernel it has no unit of is not launched (its outputs are then garbage, which the kernels after it read as
numbers only: the probe kernels, whose results become the layout's integers, run in every worker). The trainer waits
for them (`Prebuild.wait`) before its first step; each autotuner then builds from the cache and only times its
configs at the run's length. The workers' short length also keys their autotuning apart from the run's: a worker's
one-config choice is never taken for the run's.

A worker that fails or runs out of time changes nothing but the time: the trainer builds what is missing itself,
and says so. MTRAIN_PREBUILD_WORKERS sets the number of workers (0: none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

Unit = tuple[str, int]  # (kernel, index of its config after pruning; 0 for a kernel without autotuning)
ALWAYS_RUN = ("probe_partials", "probe_mass", "probe_slash")  # their results are the layout's integers: all run
MAX_WORKERS = 8
WORKER_SEQ_LEN_BLOCKS = 3  # a worker's length, in dense_below: one long document (sparse) and a short one


@dataclass(frozen=True)
class KernelShape:
    """What the kernels are specialized on: the attention's head shape, dtype and settings."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of q, k, v: bfloat16 under the trainer's autocast
    settings: dict  # AttentionConfig as a dict
    device_index: int
    seq_len: int  # the run's: the workers' length is chosen apart from it
    batch: int = 1  # rows per micro-batch (Triton specializes an integer on being 1)


def deal_units(units: Sequence[Unit], num_workers: int) -> list[list[Unit]]:
    """The units dealt round-robin over at most `num_workers` workers, none empty."""
    num_workers = max(0, min(num_workers, len(units)))
    return [list(units[w::num_workers]) for w in range(num_workers)]


def worker_seq_len(shape: KernelShape) -> int:
    """A length holding one long document and a short one; never the run's own (autotuning keys by length)."""
    block, dense_below = shape.settings["block_size"], shape.settings["dense_below"]
    length = WORKER_SEQ_LEN_BLOCKS * -(-dense_below // block) * block
    return length + block if length == shape.seq_len else length


def default_num_workers(num_units: int) -> int:
    """MTRAIN_PREBUILD_WORKERS, else one per unit up to half the cores (the trainer's own process needs some)."""
    if "MTRAIN_PREBUILD_WORKERS" in os.environ:
        return int(os.environ["MTRAIN_PREBUILD_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(num_units, MAX_WORKERS, cores // 2))


class Prebuild:
    """Worker processes building kernels into Triton's cache; `wait` once, before the first sparse call."""

    def __init__(self, processes: list[subprocess.Popen], logs: list[Path], num_units: int):
        self.processes, self.logs, self.num_units = processes, logs, num_units
        self.started = time.perf_counter()

    def wait(self, timeout_s: float = 180.0) -> tuple[str, str | None]:
        """Waits for every worker (stopping those still running after `timeout_s` from the start) -> (a line for
        the log, a warning when a worker failed or was stopped: the first sparse step builds what it lacked)."""
        problems = []
        for index, process in enumerate(self.processes):
            left = max(0.0, timeout_s - (time.perf_counter() - self.started))
            try:
                code = process.wait(timeout=left)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                problems.append(f"worker {index} still building after {timeout_s:.0f} s, stopped")
                continue
            if code != 0:
                lines = [line for line in self.logs[index].read_text(errors="replace").splitlines() if line.strip()]
                problems.append(f"worker {index} failed ({lines[-1][:200] if lines else f'exit code {code}'})")
        for log in self.logs:
            log.unlink(missing_ok=True)
        elapsed = time.perf_counter() - self.started
        line = (
            f"sparse kernels: {self.num_units} builds in {len(self.processes)} worker processes, ready "
            f"{elapsed:.1f} s after the start"
        )
        warning = (
            f"sparse kernel prebuild: {'; '.join(problems)}; the first sparse step builds what is missing itself"
            if problems
            else None
        )
        return line, warning


def start_prebuild(shape: KernelShape, num_workers: int | None = None) -> Prebuild | None:
    """Starts the workers (None when there are none to start: MTRAIN_PREBUILD_WORKERS=0, or one core)."""
    units = kernel_units(shape.settings["block_size"])
    shares = deal_units(units, default_num_workers(len(units)) if num_workers is None else num_workers)
    if not shares:
        return None
    processes, logs = [], []
    for share in shares:
        log = Path(tempfile.mkstemp(prefix="mtrain-prebuild-", suffix=".log")[1])
        argv = [sys.executable, "-c", WORKER, json.dumps(asdict(shape)), json.dumps(share)]
        with open(log, "w") as handle:
            processes.append(subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        logs.append(log)
    return Prebuild(processes, logs, len(units))


WORKER = "import sys; from mtrain_cli.attention.sparse.prebuild import worker_main; worker_main(sys.argv[1:])"


def kernel_units(block: int) -> list[Unit]:
    """Every build of the single-process path at layout block `block`: each autotuned kernel's configs that its
    pruning keeps, then the kernels without autotuning that can be dealt (not ALWAYS_RUN)."""
    units: list[Unit] = []
    for name, kernel in _autotuned().items():
        kept = (
            kernel.early_config_prune(kernel.configs, {}, BLOCK=block) if kernel.early_config_prune else kernel.configs
        )
        units += [(name, index) for index in range(len(kept))]
    return units + [(name, 0) for name in _plain()]


def _autotuned() -> dict:
    from mtrain_cli.attention.sparse.kernels_bwd import _dq_kernel
    from mtrain_cli.attention.sparse.kernels_dkdv import _dkdv_kernel
    from mtrain_cli.attention.sparse.kernels_fwd import _forward_kernel
    from mtrain_cli.attention.sparse.kernels_vertical import _vertical_kernel

    return {"forward": _forward_kernel, "dq": _dq_kernel, "dkdv": _dkdv_kernel, "vertical": _vertical_kernel}


def _plain() -> dict:
    from mtrain_cli.attention.sparse.kernels_bwd import _delta_kernel
    from mtrain_cli.attention.sparse.kernels_vertical import _fold_kernel

    return {"delta": _delta_kernel, "fold": _fold_kernel}


def _skip(*_args, **_kwargs) -> None:
    return None


def keep_only(share: Sequence[Unit]) -> None:
    """In a worker: each autotuner keeps only this worker's configs; a kernel with none of them is not launched."""
    mine = {tuple(unit) for unit in share}
    for name, kernel in _autotuned().items():
        prune = kernel.early_config_prune

        def own(configs, named_args, prune=prune, name=name, **kwargs):
            kept = prune(configs, named_args, **kwargs) if prune else configs
            return [config for index, config in enumerate(kept) if (name, index) in mine]

        if any(unit[0] == name for unit in mine):
            kernel.early_config_prune = own
        else:
            kernel.run = _skip
    for name, kernel in _plain().items():
        if (name, 0) not in mine:
            kernel.run = _skip


def build_share(shape: KernelShape, share: Sequence[Unit]) -> None:
    """One worker's builds: a short sparse forward and backward of `shape` on its GPU, with only `share` built."""
    import torch

    from mtrain_cli.attention.batch_cache import BatchCache
    from mtrain_cli.attention.settings import AttentionConfig
    from mtrain_cli.attention.sparse.ops import plan_sparse, sparse_attention_with_layout
    from mtrain_cli.attention.sparse.plan_graph import PlanGraph

    keep_only(share)
    settings = AttentionConfig(**{**shape.settings, "dense_layers": tuple(shape.settings["dense_layers"])})
    device, dtype = torch.device("cuda", shape.device_index), getattr(torch, shape.dtype)
    torch.cuda.set_device(device)
    S, block = worker_seq_len(shape), settings.block_size
    long, B = S - block, shape.batch  # one long document, then a short one: the sparse rows and the dense range
    document_ids_S = torch.cat([torch.zeros(long, dtype=torch.long), torch.ones(S - long, dtype=torch.long)])
    document_ids_BS = document_ids_S.expand(B, S).contiguous().to(device)
    # [B, S, H, D] projections seen as [B, H, S, D], as transformers hands them to attention
    q_BHSD, k_BHkSD, v_BHkSD = (
        torch.randn(B, S, heads, shape.head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        for heads in (shape.heads, shape.kv_heads, shape.kv_heads)
    )
    scale, cache = shape.head_dim**-0.5, BatchCache()
    plan = plan_sparse(q_BHSD, k_BHkSD, document_ids_BS, scale, settings, cache, PlanGraph())
    out_BHSD = sparse_attention_with_layout(q_BHSD, k_BHkSD, v_BHkSD, plan, scale, "triton", cache)
    out_BHSD.float().sum().backward()
    torch.cuda.synchronize(device)


def worker_main(argv: list[str]) -> None:
    """A worker process: argv = [the KernelShape as JSON, its share of units as JSON]."""
    build_share(KernelShape(**json.loads(argv[0])), [tuple(unit) for unit in json.loads(argv[1])])

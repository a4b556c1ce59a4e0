"""The sparse kernels' prebuild (attention/sparse/prebuild.py): every build dealt to exactly one worker, a worker
building only its share, the trainer waiting for the workers once and saying when one failed or ran out of time.
The builds themselves need a GPU (the interpreter compiles nothing): bench/cold_start.py measures them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse import prebuild
from mtrain_cli.attention.sparse.prebuild import KernelShape, Prebuild, deal_units, kernel_units


def test_every_unit_goes_to_exactly_one_worker():
    units = [("vertical", i) for i in range(4)] + [("forward", 0), ("dq", 0), ("delta", 0)]
    for workers in (1, 3, 7, 20):
        shares = deal_units(units, workers)
        assert len(shares) == min(workers, len(units)) and all(shares)
        assert sorted(unit for share in shares for unit in share) == sorted(units)
    assert deal_units(units, 0) == []


def test_the_units_are_the_autotuned_configs_and_the_plain_kernels():
    units = kernel_units(64)
    names = [name for name, _ in units]
    assert set(names) == {"forward", "dq", "dkdv", "vertical", "delta", "fold"}
    for name in ("forward", "dq", "dkdv", "vertical"):  # under the interpreter: one config each
        assert [index for unit, index in units if unit == name] == list(range(names.count(name)))


def test_a_worker_builds_its_configs_and_launches_no_kernel_outside_its_share(monkeypatch):
    kernels = {**prebuild._autotuned(), **prebuild._plain()}
    for kernel in kernels.values():  # keep_only changes the kernel objects: restored after the test
        monkeypatch.setattr(kernel, "run", kernel.run)
        if hasattr(kernel, "early_config_prune"):
            monkeypatch.setattr(kernel, "early_config_prune", kernel.early_config_prune)
    prebuild.keep_only([("forward", 0), ("fold", 0)])
    forward = kernels["forward"]
    assert forward.run is not prebuild._skip and kernels["fold"].run is not prebuild._skip
    assert forward.early_config_prune(forward.configs, {}, BLOCK=64) == forward.configs[:1]
    for name in ("dq", "dkdv", "vertical", "delta"):
        assert kernels[name].run is prebuild._skip, name
        assert kernels[name][(1,)]() is None  # a launch does nothing


def _shape(**settings) -> KernelShape:
    return KernelShape(4, 2, 64, "bfloat16", asdict(AttentionConfig(**settings)), 0, seq_len=65536)


def test_a_workers_length_holds_a_long_document_and_is_never_the_runs():
    shape = _shape(block_size=64, dense_below=8192)
    assert prebuild.worker_seq_len(shape) == 3 * 8192
    clash = KernelShape(**{**asdict(shape), "seq_len": 3 * 8192})
    assert prebuild.worker_seq_len(clash) == 3 * 8192 + 64


def _process(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_trainer_waits_for_the_workers_and_names_a_failure_or_a_timeout(tmp_path):
    logs = [tmp_path / f"{i}.log" for i in range(3)]
    for log, text in zip(logs, ["", "Traceback ...\nRuntimeError: out of resources\n", ""]):
        log.write_text(text)
    workers = [_process("pass"), _process("import sys; sys.exit(3)"), _process("import time; time.sleep(60)")]
    line, warning = Prebuild(workers, logs, num_units=9).wait(timeout_s=3)
    assert line.startswith("sparse kernels: 9 builds in 3 worker processes, ready ")
    assert warning is not None and "worker 1 failed (RuntimeError: out of resources)" in warning
    assert "worker 2 still building after 3 s, stopped" in warning and "builds what is missing itself" in warning
    assert all(worker.poll() is not None for worker in workers) and not any(log.exists() for log in logs)
    line, warning = Prebuild([_process("pass")], [Path(tmp_path / "ok.log")], 1).wait()
    assert warning is None


def test_no_workers_when_asked_for_none_or_off_the_gpu(monkeypatch):
    monkeypatch.setenv("MTRAIN_PREBUILD_WORKERS", "0")
    assert prebuild.start_prebuild(_shape()) is None
    monkeypatch.delenv("MTRAIN_PREBUILD_WORKERS")
    assert prebuild.default_num_workers(9) >= 0

    import torch

    from mtrain_cli.config import load_config
    from mtrain_cli.parallel.context import ParallelContext
    from mtrain_cli.train.parts import start_kernel_prebuild

    config = load_config("tiny", ["attention.mode=sparse"])
    assert start_kernel_prebuild(config, ParallelContext(1, 0, 1, 1, torch.device("cpu"))) is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="a worker builds on a GPU")
def test_a_worker_runs_its_share_on_the_gpu():
    shape = _shape(block_size=64, dense_below=1024)
    units = kernel_units(64)
    prebuild.build_share(shape, units[: len(units) // 2])

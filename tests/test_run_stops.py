"""Nothing is lost when a run stops early: SIGTERM and SIGUSR1 save like Ctrl-C (every rank at one step); a
non-finite loss stops in one line and saves and exports nothing of it; a full disk says so in one line, removes
what it partly wrote and keeps earlier checkpoints. The disk is filled by failing writes with ENOSPC in this
process (checkpoint, export, metrics.jsonl), and for real on a small tmpfs where the machine allows one."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from rich.console import Console
from safetensors import SafetensorError
from spawned_ranks import ForkedCLI
from tiny_setup import cli_env, only_run_dir, run_cli, set_args, small_run, step_losses

from mtrain_cli.config import load_config
from mtrain_cli.errors import DiskFull, TrainingDiverged
from mtrain_cli.train.checkpoint import checkpoint_dirs, verify_checkpoint
from mtrain_cli.train.export import export_hf
from mtrain_cli.train.run import run_extend


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def start(
    out: Path, num_steps: int, *extra: str, nproc: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen | ForkedCLI:
    """A run to signal: one process forked from the preloaded forkserver; --nproc N under torchrun, whose launch
    is part of what those tests test."""
    args = ["extend", *set_args(small_run(num_steps, out, "checkpoint.export=false", *extra))]
    if nproc == 1:
        return ForkedCLI(*args, env=env)
    return subprocess.Popen(
        [sys.executable, "-m", "mtrain_cli", *args, "--nproc", str(nproc)],
        env={**cli_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait_for_steps(out: Path, num_steps: int, process: subprocess.Popen | ForkedCLI) -> Path:
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        runs = [p for p in out.iterdir() if p.is_dir()] if out.exists() else []
        if runs and (runs[0] / "metrics.jsonl").exists() and len(step_losses(runs[0])) >= num_steps:
            return runs[0]
        time.sleep(0.01)
    raise AssertionError(f"run did not reach step {num_steps}: {process.communicate()[0][-2000:]}")


# -- 3. stop signals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_schedulers_stop_signal_saves_a_checkpoint_and_exits_with_its_code(tmp_path, signum):
    num_steps = 60
    process = start(tmp_path, num_steps, "checkpoint.every=50")
    run_dir = wait_for_steps(tmp_path, 3, process)
    process.send_signal(signum)
    log = process.communicate(timeout=120)[0]
    assert process.returncode == 128 + signum, log  # 143 for SIGTERM, 138 for SIGUSR1
    name = signal.Signals(signum).name
    assert f"{name}: finishing this step and saving a checkpoint" in log
    assert f"interrupted ({name}); checkpoint saved to" in log and f"mtrain extend --resume {run_dir}" in log
    stopped_at = max(step_losses(run_dir))
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert stopped_at < num_steps and saved[-1][0] == stopped_at, (stopped_at, saved)
    verify_checkpoint(saved[-1][1])


def test_a_second_ctrl_c_aborts_at_once_without_a_traceback(tmp_path):
    """The first Ctrl-C finishes the step and saves; a second one, while that runs, exits at once (130) in one
    line: no checkpoint of that step, no traceback (raised inside the save, DCP wrapped it: exit 1, traceback)."""
    process = start(tmp_path, 60, "checkpoint.every=2")
    run_dir = wait_for_steps(tmp_path, 3, process)
    process.send_signal(signal.SIGINT)
    notice = "Ctrl-C: finishing this step and saving a checkpoint (Ctrl-C again to abort)"
    seen = ""
    while notice not in seen:
        seen += process.stdout.readline()
    process.send_signal(signal.SIGINT)
    started = time.perf_counter()
    log = seen + process.communicate(timeout=120)[0]
    assert process.returncode == 130, log[-3000:]
    assert time.perf_counter() - started < 10, log[-3000:]
    assert "aborted (Ctrl-C again): steps after the last checkpoint are not saved" in log, log[-3000:]
    assert "Traceback" not in log and "checkpoint saved" not in log, log[-3000:]
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert saved, log[-3000:]
    verify_checkpoint(saved[-1][1])  # a save cut short is a .tmp directory, never a checkpoint


def test_a_stop_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Under torchrun (gloo, 2 ranks, cp 2) the signal reaches rank 1 only: rank 0 learns of it at the end of the
    step and both save that step's checkpoint together."""
    process = start(tmp_path, 60, "checkpoint.every=50", "parallel.cp=2", "attention.block_size=32", nproc=2)
    run_dir = wait_for_steps(tmp_path, 2, process)
    (rank_1,) = [
        child
        for child in psutil.Process(process.pid).children(recursive=True)
        if "mtrain_cli" in child.cmdline() and child.environ().get("RANK") == "1"
    ]
    rank_1.send_signal(signal.SIGTERM)
    log = process.communicate(timeout=240)[0]
    assert process.returncode != 0, log
    stopped_at = max(step_losses(run_dir))
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert saved[-1][0] == stopped_at < 60, (saved, stopped_at, log[-3000:])
    assert {path.name for path in saved[-1][1].glob("state_rank*.pt")} == {"state_rank0.pt", "state_rank1.pt"}
    verify_checkpoint(saved[-1][1])
    assert log.count(f"interrupted (SIGTERM); checkpoint saved to {saved[-1][1]}") == 1, log[-3000:]


def test_a_signal_landing_during_the_stop_vote_waits_for_the_next_step():
    """A rank decides from the reduced counts alone. A signal that lands while the all-reduce runs (here: inside
    it) was not in this rank's vote, so the other ranks did not hear of it: stopping now would leave them in the
    next step's collectives (the hang the 2-rank test above met under load). It counts at the next step."""
    from mtrain_cli.train.stops import StopRequests

    def sum_all(votes):  # the other rank voted 0; SIGTERM reaches this rank during the collective
        stops._on_signal(signal.SIGTERM, None)
        return votes

    stops = StopRequests(Console(file=io.StringIO()), cleanup=lambda: None)
    assert stops.agree(sum_all) is None
    assert stops.agree(sum_all) == signal.SIGTERM  # its vote now counts everywhere
    heard = StopRequests(Console(file=io.StringIO()), cleanup=lambda: None)
    assert heard.agree(lambda votes: votes + torch.eye(3)[2]) == signal.SIGUSR1  # another rank's (STOP_SIGNALS order)


def _stopped_rank(rank: int, world: int, port: int, out: str) -> None:
    import gc

    import torch.distributed as dist

    from mtrain_cli.train.loop import Trainer
    from mtrain_cli.train.stops import Interrupted, StopRequests

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    alive, destroy = [], dist.destroy_process_group

    def counted_destroy():
        alive.append(sum(isinstance(o, Trainer) for o in gc.get_objects()))
        destroy()

    dist.destroy_process_group = counted_destroy
    votes = iter(range(1, 100))  # one vote a step: every rank stops after its second step
    StopRequests.agree = lambda stops, sum_all: signal.SIGTERM if next(votes) == 2 else None
    config = load_config("tiny", small_run(6, Path(out), "parallel.cp=2", "attention.block_size=32"))
    with pytest.raises(Interrupted):
        run_extend(config, None, quiet())
    assert alive == [0], f"rank {rank}: {alive[0]} trainer(s) alive when the process groups were destroyed"


def test_a_stopped_run_frees_its_trainer_before_destroying_the_process_groups(tmp_path):
    """The Interrupted on its way out holds the trainer in its traceback; NCCL's destroy waited forever with it
    alive (an 8B run on 2 GPUs, after its SIGTERM checkpoint). Both gloo ranks count none alive there."""
    from spawned_ranks import run_ranks

    run_ranks(_stopped_rank, 2, str(tmp_path / "runs"), error_dir=tmp_path)


def test_ctrl_c_under_nproc_reaches_the_ranks_not_torchrun_which_would_kill_them(tmp_path):
    """torchrun SIGKILLs its ranks a grace after it receives a stop signal (30 s, fixed before torch 2.12). Here
    the grace is 0 s, and Ctrl-C goes to the launcher's whole process group, as from a terminal: the ranks
    still finish the step and save, because torchrun runs in its own session and never sees the signal."""
    process = start(
        tmp_path, 60, "checkpoint.every=50", "parallel.cp=2", "attention.block_size=32", nproc=2,
        env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"},
    )  # fmt: skip
    run_dir = wait_for_steps(tmp_path, 2, process)
    os.killpg(process.pid, signal.SIGINT)
    log = process.communicate(timeout=240)[0]
    assert process.returncode == 130, log[-3000:]
    stopped_at = max(step_losses(run_dir))
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert saved and saved[-1][0] == stopped_at < 60, (saved, stopped_at, log[-3000:])
    verify_checkpoint(saved[-1][1])
    assert log.count(f"interrupted (Ctrl-C); checkpoint saved to {saved[-1][1]}") == 1, log[-3000:]


# -- 4. a non-finite loss -------------------------------------------------------------------------------------


def test_a_nonfinite_loss_stops_in_one_line_keeps_the_last_good_checkpoint_and_exports_nothing(tmp_path):
    overrides = small_run(8, tmp_path, "train.lr=1e9", "train.warmup_steps=0", "checkpoint.every=1")
    result = run_cli("extend", *set_args(overrides))
    assert result.returncode == 3, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    match = re.match(r"error: step (\d+): loss (nan|inf), gradient norm (\S+): training diverged", lines[0])
    assert match, lines[0]
    step, run_dir = int(match.group(1)), only_run_dir(tmp_path)
    assert "done" not in result.stdout
    assert not (run_dir / "export").exists() and not (run_dir / "export.tmp").exists()
    assert not (run_dir / "summary.json").exists()
    saved = checkpoint_dirs(run_dir / "checkpoints")
    assert saved and saved[-1][0] == step - 1, saved  # the last step whose loss was finite
    assert f"the newest checkpoint, {saved[-1][1]}, is from before it" in lines[0]

    # metrics.jsonl is strict JSON (jq, JavaScript): no bare NaN; the diverged step's values are strings
    def no_constant(name):
        raise AssertionError(f"metrics.jsonl holds a bare {name}")

    records = [json.loads(line, parse_constant=no_constant) for line in (run_dir / "metrics.jsonl").open()]
    assert records[-1]["step"] == step and records[-1]["loss"] in ("nan", "inf"), records[-1]
    verify_checkpoint(saved[-1][1])


def test_an_export_of_non_finite_weights_writes_nothing(tmp_path):
    from fixtures.eval_corpus import shipped_tokenizer, write_tiny_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "model"))
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    with pytest.raises(TrainingDiverged, match=r"model.layers.1.mlp.up_proj.weight holds non-finite values"):
        export_hf(model, shipped_tokenizer(), tmp_path / "export")
    assert not (tmp_path / "export").exists() and not (tmp_path / "export.tmp").exists()


# -- 5. a full disk -------------------------------------------------------------------------------------------


class FullDisk:
    """Writes to files whose path contains `match` fail with ENOSPC once `room` bytes are written to them, as on
    a disk that fills up (patched into open(): torch.save, DCP and metrics.jsonl write through it)."""

    def __init__(self, monkeypatch, match: str, room: int):
        self.match, self.room, self.real_open = match, room, builtins.open
        monkeypatch.setattr(builtins, "open", self.open)
        monkeypatch.setattr(io, "open", self.open)

    def open(self, file, mode="r", *args, **kwargs):
        handle = self.real_open(file, mode, *args, **kwargs)
        if self.match in str(file) and any(flag in mode for flag in "wax+"):
            return _Filling(handle, self)
        return handle


class _Filling:
    def __init__(self, handle, disk: FullDisk):
        self._handle, self._disk = handle, disk

    def write(self, data):
        size = memoryview(data).nbytes if not isinstance(data, str) else len(data.encode())
        if size > self._disk.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.room -= size
        return self._handle.write(data)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    config = load_config("tiny", small_run(3, tmp_path, "checkpoint.every=1", "checkpoint.export=false"))
    FullDisk(monkeypatch, "step_000002.tmp", room=5000)
    with pytest.raises(DiskFull) as excinfo:
        run_extend(config, None, quiet())
    message, run_dir = str(excinfo.value), only_run_dir(tmp_path)
    assert "\n" not in message and excinfo.value.exit_code == 4
    assert message.startswith(f"no space left on the disk writing {run_dir / 'checkpoints' / 'step_000002'} (about ")
    assert "MB needed" in message or "kB needed" in message
    assert "the partial checkpoint is removed; earlier checkpoints are intact (step_000001)" in message
    assert f"mtrain extend --resume {run_dir}" in message
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000001")


def test_a_full_disk_during_the_export_is_one_line_and_leaves_no_partial_export(tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", no_space)
    config = load_config("tiny", small_run(2, tmp_path))
    with pytest.raises(DiskFull) as excinfo:
        run_extend(config, None, quiet())
    run_dir = only_run_dir(tmp_path)
    assert str(excinfo.value).startswith(f"no space left on the disk writing {run_dir / 'export'} (about ")
    assert f"the partial export is removed; free some space and run mtrain extend --resume {run_dir}" in str(
        excinfo.value
    )
    assert not (run_dir / "export").exists() and not (run_dir / "export.tmp").exists()
    verify_checkpoint(run_dir / "checkpoints" / "step_000002")


def test_a_full_disk_writing_metrics_jsonl_is_one_line(tmp_path, monkeypatch):
    config = load_config("tiny", small_run(4, tmp_path, "checkpoint.every=1", "checkpoint.export=false"))
    FullDisk(monkeypatch, "metrics.jsonl", room=700)
    with pytest.raises(DiskFull) as excinfo:
        run_extend(config, None, quiet())
    run_dir = only_run_dir(tmp_path)
    assert str(excinfo.value).startswith(f"no space left on the disk writing {run_dir / 'metrics.jsonl'}")
    assert checkpoint_dirs(run_dir / "checkpoints")  # what was saved before stays


def _can_mount_tmpfs(directory: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k none {directory}"],
        capture_output=True,
    )
    return probe.returncode == 0


def test_a_real_full_disk_through_the_cli(tmp_path):
    """A 2.6 MB tmpfs (in a user and mount namespace) holds one checkpoint of the small model (~1.4 MB) but not
    two: the second save fails. The namespace's files are copied out before it ends."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("no user namespaces here to mount a small tmpfs")
    args = set_args(small_run(3, disk / "runs", "checkpoint.every=1", "checkpoint.keep_last=1"))
    command = " ".join([sys.executable, "-m", "mtrain_cli", "extend", *args])
    script = f"mount -t tmpfs -o size=2600k none {disk} && {command}; code=$?; cp -a {disk} {kept}; exit $code"
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=300,
    )
    assert result.returncode == 4, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    run_dir = only_run_dir(kept / "runs")
    assert lines[0].startswith(f"error: no space left on the disk writing {disk / 'runs' / run_dir.name}/checkpoints/")
    assert "MB needed" in lines[0] and "the partial checkpoint is removed; earlier checkpoints are intact" in lines[0]
    assert [path.name for path in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000001")

"""`logging.wandb=true` under WANDB_MODE=offline: the run's wandb directory holds every step's metrics, no network.

wandb (0.31) writes an offline run as `<run dir>/wandb/offline-run-*/run-<id>.wandb`: a LevelDB-style log (7-byte
header, 32 KiB blocks, records of crc32 + length + type) whose records are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from spawned_ranks import run_forked_cli
from tiny_setup import cli_env, only_run_dir, set_args, small_run, step_losses

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every record of a .wandb file, in order."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, pieces = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            pos += left
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
        else:
            assert kind in (FIRST, MIDDLE), kind
    return records


def test_offline_wandb_run_holds_the_logged_metrics(tmp_path):
    out, num_steps = tmp_path / "runs", 3
    wandb_home = {
        name: str(tmp_path / name.lower())
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
    }
    env = {**cli_env(), **wandb_home, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = set_args(small_run(num_steps, out, "checkpoint.export=false", "logging.wandb=true"))
    result = run_forked_cli("extend", *args, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = only_run_dir(out)

    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
    (log_file,) = offline_run.glob("run-*.wandb")
    records = wandb_records(log_file)
    kinds = [record.WhichOneof("record_type") for record in records]
    assert kinds[0] == "header" and "run" in kinds and kinds[-1] == "exit", kinds  # finished, not cut off

    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.HasField("history")
    ]
    logged = {row["step"]: row["loss"] for row in history if "loss" in row}
    assert logged == {step: losses[-1] for step, losses in step_losses(run_dir).items()}
    assert sorted(logged) == list(range(1, num_steps + 1))
    assert all({"lr", "grad_norm", "tokens_per_s"} <= row.keys() for row in history if "loss" in row)
    assert [row["step"] for row in history if "val_loss" in row] == [0, num_steps]

"""`mtrain profile ring` on the 4 ranks torchrun starts (forked with its environment; gloo, 2 declared nodes):
every mode runs and reports time, hidden/unhidden communication, imbalance, recall and the chunk pairs on the
library and on our kernels; the ratio to torch CP cuDNN is its time over ours; without torchrun it is a one-line
error."""

from __future__ import annotations

import json

from spawned_ranks import run_cli_ranks
from tiny_setup import run_cli

from mtrain_cli.profile.ring import add_torch_cp_ratio, ring_table


def test_profile_ring_under_torchrun(tmp_path):
    out = tmp_path / "ring.json"
    args = [
        "profile",
        "ring",
        "--seq-len",
        "1k",
        "--node-size",
        "2",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--block-size",
        "16",
        "--repeats",
        "1",
        "--out",
        str(out),
        "--modes",
        "sparse-stripe,sparse-zigzag,sparse-hierarchical,dense-zigzag",
    ]
    result = run_cli_ranks(4, *args)  # the ranks torchrun starts, forked
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world"] == 4 and report["backend"] == "gloo"
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"sparse-stripe", "sparse-zigzag", "sparse-hierarchical", "dense-zigzag"}
    assert rows["sparse-hierarchical"]["node_size"] == 2 and rows["sparse-stripe"]["node_size"] == 4
    for mode, row in rows.items():
        assert row["fwd_bwd_ms"] > 0 and 0.0 <= row["comm_not_hidden_share"] < 1.0, mode
        assert row["busy_imbalance"] >= 1.0 and row["work_imbalance"] >= 1.0, mode
        assert len(row["work_blocks_by_rank"]) == 4
    # the same pattern on both layouts: the same total work, only its split over ranks differs
    assert sum(rows["sparse-stripe"]["work_blocks_by_rank"]) == sum(rows["sparse-zigzag"]["work_blocks_by_rank"])
    assert sum(rows["dense-zigzag"]["work_blocks_by_rank"]) > sum(rows["sparse-zigzag"]["work_blocks_by_rank"])
    assert rows["sparse-stripe"]["recall"] > 0.9 and rows["dense-zigzag"]["recall"] is None
    assert (tmp_path / "ring.md").read_text().count("| sparse-") == 3
    # one document: every dense zigzag chunk pair (4 ranks: 36) runs the library; sparse pairs never do
    assert (rows["dense-zigzag"]["library_pairs"], rows["dense-zigzag"]["kernel_pairs"]) == (36, 0)
    assert rows["sparse-zigzag"]["library_pairs"] == 0 and rows["sparse-zigzag"]["kernel_pairs"] == 36
    assert "| 36 / 0 |" in (tmp_path / "ring.md").read_text()


def test_ratio_to_torch_cp_is_its_time_over_ours():
    rows = [
        {"mode": "dense-zigzag", "seq_len": 262144, "fwd_bwd_ms": 400.0, "library_pairs": 36, "kernel_pairs": 0},
        {"mode": "torch-cp-cudnn", "seq_len": 262144, "fwd_bwd_ms": 500.0},
        {"mode": "sparse-stripe", "seq_len": 262144, "fwd_bwd_ms": 50.0, "library_pairs": 0, "kernel_pairs": 4},
    ]
    add_torch_cp_ratio(rows)
    assert rows[0]["vs_torch_cp_cudnn"] == 1.25 and rows[2]["vs_torch_cp_cudnn"] == 10.0
    assert "vs_torch_cp_cudnn" not in rows[1]
    result = {"device": "H200", "world": 4, "backend": "nccl", "engine": "triton", "torch": "2.11", "triton": "3"}
    table = ring_table({**result, "rows": rows})
    assert "| dense-zigzag | 256K | 400.0 | 1.25 |" in table and "| 36 / 0 |" in table
    errored = [{**rows[0]}, {"mode": "torch-cp-cudnn", "error": "cuDNN unavailable"}]
    errored[0].pop("vs_torch_cp_cudnn")
    add_torch_cp_ratio(errored)
    assert "vs_torch_cp_cudnn" not in errored[0]


def test_profile_ring_needs_torchrun():
    result = run_cli("profile", "ring", "--seq-len", "1k")
    assert result.returncode == 2 and "runs under torchrun" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

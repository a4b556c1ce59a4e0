"""bench.step_variants: the settings it parses, the corpus command it rebuilds from a job's manifest, and the table
it makes of `mtrain profile step` JSONs (the profiles themselves need a GPU and a trained model)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.step_variants import corpus_command, summary, table, variant


def test_a_setting_is_a_name_and_its_overrides():
    assert variant("p95lq512:attention.p=0.95,attention.last_q=512") == (
        "p95lq512",
        ["attention.p=0.95", "attention.last_q=512"],
    )
    assert variant("shipped_p95") == ("shipped_p95", [])
    for bad in ("p95:attention.p", ":attention.p=0.9", "a b:attention.p=0.9"):
        with pytest.raises(argparse.ArgumentTypeError):
            variant(bad)


def test_the_corpus_is_rebuilt_with_every_option_of_the_manifest(tmp_path):
    cmd = corpus_command(tmp_path, {"seed": 0, "max_mb": 200.0, "long_context": 131072, "source_root": ["/a", "/b"]})
    flags = cmd[cmd.index("--out") :]
    assert flags == [
        "--out", str(tmp_path), "--seed", "0", "--max-mb", "200.0", "--long-context", "131072",
        "--source-root", "/a", "--source-root", "/b",
    ]  # fmt: skip


def _profile(step_ms: float, dq_ms: float | None, density: float | None) -> dict:
    phases = {"attention": step_ms * 0.8, "plan": 5.0, "matmul": 30.0, "communication": 0.0, "optimizer": 0.3}
    attention = [["_dq_kernel", dq_ms]] if dq_ms is not None else [["cudnn_generated_fort_native_sdpa", 800.0]]
    return {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "mean": {"step_ms": step_ms, **phases, "other": 30.0, "idle_ms": 4.0, "idle_before": {"plan": 2.5}},
        "top_kernels": {"attention": attention, "plan": [["_probe_mass_kernel", 1.5]] if dq_ms else []},
        "sparse_density": density,
        "sparse_recall": 0.95 if density else None,
    }


def test_the_table_sets_each_setting_against_the_dense_step_and_lists_our_kernels():
    rows = [
        summary(_profile(1200.0, None, None), "dense", ["attention.mode=dense"]),
        summary(_profile(480.0, 120.0, 0.24), "sparse", ["attention.mode=sparse"]),
    ]
    json.dumps(rows)  # what the JSON beside the table holds
    lines = {line.split(" | ")[0]: line for line in table(rows).splitlines()}
    assert lines["| dense step / this step"].endswith("| 1.00× | 2.50× |")
    assert lines["| `_dq_kernel`, ms"].endswith("| – | 120.00 |")
    assert lines["| GPU idle (of it waiting for the plan), ms"].endswith("| 4.0 (2.5) | 4.0 (2.5) |")
    assert lines["| density / recall"].endswith("| – | 0.240 / 0.950 |")
    assert not any("cudnn" in line for line in lines)  # others' kernel names stay in each profile's own table

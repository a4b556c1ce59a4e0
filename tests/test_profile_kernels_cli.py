"""`mtrain profile kernels` rejects bad arguments with one line and exit code 2, on any machine."""

from __future__ import annotations

import pytest
from tiny_setup import run_cli


@pytest.mark.parametrize(
    "args,message",
    [
        (["--block-sizes", "64,96"], "--block-sizes '64,96' must list 64 and/or 128"),
        (["--patterns", "planted,zigzag"], "--patterns 'planted,zigzag' must be planted, random or both"),
        (["--lengths", "128q"], "--lengths '128q'"),
        (["--planted-slashes", "16,0"], "--planted-slashes '16,0' must list positive integers"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, message):
    result = run_cli("profile", "kernels", *args, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_markdown_table_names_each_planted_case_by_its_slash_count():
    from mtrain_cli.profile.kernels import kernel_profile_table

    def row(pattern, num_slash, density):
        return {
            "seq_len": 131072,
            "pattern": pattern,
            "planted_slashes": num_slash,
            "block": 64,
            "density": density,
            "recall": None,
            "sparse_fwd_ms": 1.0,
            "sparse_bwd_ms": 2.0,
            "sparse_fwd_bwd_ms": 3.0,
            "sparse_fwd_bwd_tflops": 100.0,
        }

    rows = [row("planted", 16, 0.081), row("planted", 8, 0.131), row("random", None, 0.071)]
    result = {
        "device": "GPU",
        "torch": "t",
        "triton": "x",
        "rows": rows,
        "shape": {"num_heads": 16, "num_kv_heads": 2, "head_dim": 128, "dtype": "bf16"},
    }
    lines = kernel_profile_table(result).splitlines()
    assert lines[-3].startswith("| 128K | planted (16) | 64 | 0.081 | – |")
    assert lines[-2].startswith("| 128K | planted (8) | 64 | 0.131 | – |")
    assert lines[-1].startswith("| 128K | random | 64 | 0.071 | – |")
    assert all(line.count("|") == lines[2].count("|") for line in lines[2:])  # every row fills every column

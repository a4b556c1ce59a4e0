"""`mtrain profile kernels` rejects bad arguments with one line and exit code 2, on any machine."""

from __future__ import annotations

import pytest

from tiny_setup import run_cli


@pytest.mark.parametrize("args,message", [
    (["--block-sizes", "64,96"], "--block-sizes '64,96' must list 64 and/or 128"),
    (["--patterns", "planted,zigzag"], "--patterns 'planted,zigzag' must be planted, random or both"),
    (["--lengths", "128q"], "--lengths '128q'"),
])
def test_bad_arguments_get_one_line_and_exit_2(args, message):
    result = run_cli("profile", "kernels", *args, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr

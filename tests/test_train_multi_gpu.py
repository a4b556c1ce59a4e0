"""bench/train_multi_gpu.py inside its --budget, on CPU: a Python child that prints and sleeps stands in for
`mtrain extend --nproc`. Its SIGTERM comes at the budget less the grace and the results' margin, counted from the
command's start; the log and a "running" row are in --out while it runs; a case the budget cannot fit is skipped;
a budget with no time for a launch is refused in one line."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import pytest

from bench import train_multi_gpu as bench

# prints without flushing: the log in --out has the line while the child runs only if the launch's output is
# unbuffered, as the ranks' must be for a killed call to return it
FAKE_RANKS = """
import signal, sys, time
def stop(*_):
    print("SIGTERM at", time.time())
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("step 1")
time.sleep(30)
"""


def wait_for(check, timeout: float):
    deadline = time.monotonic() + timeout
    while not (found := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def test_sigterm_at_the_budget_with_the_log_and_a_running_row_in_out_first(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "STOP_GRACE_S", 1.0)
    monkeypatch.setattr(bench, "RESULTS_S", 0.5)
    monkeypatch.setattr(bench, "MIN_LAUNCH_S", 0.5)
    monkeypatch.setattr(bench, "device_info", lambda: {"device": "cpu", "num_gpus": 2, "torch": "-", "triton": "-"})
    monkeypatch.setattr(bench, "extend_command", lambda *_: [sys.executable, "-c", FAKE_RANKS])
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    (work / "long_256k.jsonl").write_text("{}\n")  # the documents of an earlier call
    cases = "qwen2.5-3b-256k-sparse,qwen2.5-3b-256k-dense"
    argv = ["--out", str(out), "--work", str(work), "--cases", cases, "--budget", "3.5"]  # SIGTERM at 2 s
    started = time.time()
    command = threading.Thread(target=bench.main, args=(argv,))
    command.start()

    log = out / "qwen2.5-3b-256k-sparse.log"
    assert wait_for(lambda: log.exists() and "step 1" in log.read_text(), 1.5)
    rows = json.loads((out / "train_2gpu.json").read_text())["rows"]
    assert command.is_alive()
    assert [(r["case"], r["status"]) for r in rows] == [("qwen2.5-3b-256k-sparse", "running")]
    assert "running" in (out / "train_2gpu.md").read_text()

    command.join(timeout=10)
    assert not command.is_alive()
    sigterm_s = float(log.read_text().split("SIGTERM at")[1]) - started
    assert 1.95 < sigterm_s < 2.8
    result = json.loads((out / "train_2gpu.json").read_text())
    assert result["sigterm_at_s"] == 2.0
    stopped, skipped = result["rows"]
    assert (stopped["status"], stopped["rc"], stopped["steps"]) == ("done", "stopped", 0)
    assert "step 1" in stopped["log_tail"]
    assert skipped["status"] == "skipped" and skipped["reason"].startswith("time budget: 0 s left")
    assert skipped["reason"] in (out / "train_2gpu.md").read_text()


@pytest.mark.parametrize(
    ("child", "rc", "seconds"), [("import sys; sys.exit(3)", 3, (0, 0.3)), (None, "killed", (0.75, 1.5))]
)
def test_launch_returns_the_rc_or_kills_a_launch_the_grace_after_sigterm(tmp_path, monkeypatch, child, rc, seconds):
    monkeypatch.setattr(bench, "STOP_GRACE_S", 0.5)
    ignores_sigterm = f"import signal, time; signal.signal({signal.SIGTERM.value}, signal.SIG_IGN); time.sleep(30)"
    started = time.monotonic()
    assert bench.launch([sys.executable, "-c", child or ignores_sigterm], tmp_path / "log", started + 0.3) == rc
    assert seconds[0] < time.monotonic() - started < seconds[1]


@pytest.mark.parametrize("budget", ["250", "309"])
def test_a_budget_with_no_time_for_a_launch_is_refused_in_one_line(tmp_path, capsys, budget):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--out", str(tmp_path / "out"), "--cases", "qwen2.5-3b-256k-sparse", "--budget", budget])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"--budget {budget}: no case can run")
    assert not (tmp_path / "out").exists()

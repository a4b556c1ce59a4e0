"""bench.extension.rerun: an extension trained again replaces the report's run only when its loss equals the
earlier run's at every step (the same model, so the report's evaluations are its own); otherwise one line says
at which step they part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.extension.handoff import JobsError
from bench.extension.rerun import join


def state(work: Path, run: str, losses: list[float], job: str, date: str, seconds: list[float]):
    """A restored job state holding a dense run and a `run` extension trained in job `job`."""
    records = []
    for name in ("dense", run):
        run_dir = work / "runs" / name / f"{name}-{date}"
        run_dir.mkdir(parents=True)
        steps = [
            {"step": i + 1, "loss": x, "tokens_per_s": 1.0, "step_s": s}
            for i, (x, s) in enumerate(zip(losses, seconds))
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in steps))
        meta = {"job": job if name == run else "dense"}
        records.append({"name": name, "status": "pass", "run_dir": str(run_dir), "command": "", "meta": meta})
    (work / "profile").mkdir()
    (work / "profile" / f"{run}.json").write_text(json.dumps({"job": job}))
    records.append({"name": f"profile-{run}", "status": "pass", "run_dir": str(work / "profile"), "meta": {"job": job}})
    records.append({"name": "eval-sparse-niah-s0-4K", "status": "pass", "run_dir": "", "meta": {"job": "eval"}})
    header = {"jobs": [{"phase": "dense", "date_utc": "1"}, {"phase": job, "date_utc": date}], "notes": []}
    return header, records


def test_a_rerun_with_the_same_losses_replaces_the_run_and_keeps_the_evaluations(tmp_path):
    work, rerun = tmp_path / "report", tmp_path / "rerun"
    header, records = state(work, "sparse", [2.5, 2.25, 2.0], "sparse", "2", [1.0, 0.5, 0.5])
    rerun_header, rerun_records = state(rerun, "sparse", [2.5, 2.25, 2.0], "sparse", "3", [1.0, 0.4, 0.4])
    rerun_header["jobs"][-1]["git_commit"] = "c" * 40
    assert join(work, header, records, rerun, rerun_header, rerun_records) == "sparse"
    sparse = next(r for r in records if r["name"] == "sparse")
    assert Path(sparse["run_dir"]).parent == work / "runs" / "sparse"  # copied into the report's work directory
    assert [d.name for d in (work / "runs" / "sparse").iterdir()] == ["sparse-3"]  # the earlier one gone
    steps = [json.loads(line) for line in (Path(sparse["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step_s"] for m in steps] == [1.0, 0.4, 0.4]  # the rerun's times
    assert json.loads((work / "profile" / "sparse.json").read_text()) == {"job": "sparse"}
    assert [r["name"] for r in records] == ["dense", "sparse", "profile-sparse", "eval-sparse-niah-s0-4K"]
    assert [j["date_utc"] for j in header["jobs"]] == ["1", "3"]  # the rerun's job in place of the earlier one
    assert "all 3 steps" in header["notes"][0] and "cccccccccccc" in header["notes"][0]


@pytest.mark.parametrize(
    "rerun_losses, where", [([2.5, 2.25, 2.0000001], "at step 3"), ([2.5, 2.25], "in length \\(2 / 3\\)")]
)
def test_a_rerun_whose_loss_differs_is_refused(tmp_path, rerun_losses, where):
    work, rerun = tmp_path / "report", tmp_path / "rerun"
    header, records = state(work, "sparse", [2.5, 2.25, 2.0], "sparse", "2", [1.0, 0.5, 0.5])
    rerun_header, rerun_records = state(rerun, "sparse", rerun_losses, "sparse", "3", [1.0, 0.4, 0.4])
    with pytest.raises(JobsError, match=f"the sparse rerun's losses differ from the report's {where}"):
        join(work, header, records, rerun, rerun_header, rerun_records)
    assert next(r for r in records if r["name"] == "sparse")["run_dir"].startswith(str(work))  # untouched

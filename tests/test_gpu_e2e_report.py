"""bench.gpu_e2e's merge of results from separate device calls: a flow's latest run wins, and each part is
described by the flows kept from it and the commit it ran."""

from __future__ import annotations

import json

from bench.gpu_e2e.report import merge


def part(date: str, commit: str, runs: dict[str, str]) -> dict:
    return {
        "scale": "gpu",
        "gpu": "h200",
        "gpu_name": "NVIDIA H200",
        "date_utc": date,
        "source": {"git_commit": commit, "src_sha256": "0", "git_dirty": []},
        "flows_selected": list(runs),
        "flows": [{"name": n, "status": s, "command": "", "metrics": {}} for n, s in runs.items()],
        "elapsed_s": 10.0,
        "budget_s": 20,
        "complete": True,
    }


def test_a_merge_keeps_each_flows_latest_run_and_says_which_part_gave_it(tmp_path):
    old = part("2026-11-27", "a" * 40, {"pretrain": "pass", "qwen3-model": "pass", "profile-kernels": "pass"})
    new = part("2026-11-28", "b" * 40, {"pretrain": "pass", "qwen3-model": "skipped", "profile-kernels": "fail"})
    paths = []
    for i, p in enumerate((old, new)):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(p))
    merge(paths, tmp_path / "out")

    merged = json.loads((tmp_path / "out" / "gpu_e2e_h200.json").read_text())
    by_name = {r["name"]: (r["status"], r["part"]) for r in merged["flows"]}
    # a skip never hides an earlier run; a failure does
    assert by_name == {"pretrain": ("pass", 1), "qwen3-model": ("pass", 0), "profile-kernels": ("fail", 1)}
    assert merged["counts"] == {"pass": 2, "fail": 1, "skipped": 0, "pending": 0}
    text = (tmp_path / "out" / "gpu_e2e_h200.md").read_text()
    assert "part 0: qwen3-model (2026-11-27, aaaaaaaaaaaa)" in text
    assert "part 1: pretrain, profile-kernels (2026-11-28, bbbbbbbbbbbb)" in text


def test_merging_a_merge_keeps_each_flow_with_the_call_that_ran_it(tmp_path):
    runs = [
        part("2026-11-27", "a" * 40, {"pretrain": "pass", "qwen3-model": "pass"}),
        part("2026-11-28", "b" * 40, {"pretrain": "pass", "profile-kernels": "pass"}),
        part("2026-11-29", "c" * 40, {"pretrain": "pass", "qwen3-model": "fail"}),
    ]
    paths = []
    for i, p in enumerate(runs):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(p))
    merge(paths[:2], tmp_path / "first")
    merge([tmp_path / "first" / "gpu_e2e_h200.json", paths[2]], tmp_path / "out")

    merged = json.loads((tmp_path / "out" / "gpu_e2e_h200.json").read_text())
    # the first call's part gave nothing kept: it is gone, and no part holds parts of its own
    assert [p["date_utc"] for p in merged["parts"]] == ["2026-11-28", "2026-11-29"]
    assert not any("parts" in p or "flows" in p for p in merged["parts"])
    by_name = {r["name"]: (r["status"], r["part"]) for r in merged["flows"]}
    assert by_name == {"pretrain": ("pass", 1), "qwen3-model": ("fail", 1), "profile-kernels": ("pass", 0)}
    assert merged["elapsed_s"] == 30.0
    text = (tmp_path / "out" / "gpu_e2e_h200.md").read_text()
    assert "run as 2 device calls" in text
    assert "part 0: profile-kernels (2026-11-28, bbbbbbbbbbbb); part 1: pretrain, qwen3-model (2026-11-29, cccc" in text

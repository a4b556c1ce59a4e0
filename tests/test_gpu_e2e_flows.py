"""bench/gpu_e2e's flow registry: the flows in their order at both scales, a --flows selection with its
prerequisites, and a group whose flow would run before its prerequisite refused. (The flows themselves run
with `python -m bench.gpu_e2e --scale cpu`, about 10 minutes on 2 cores.)"""

from __future__ import annotations

import pytest

from bench.gpu_e2e import flows as registry
from bench.gpu_e2e.flows import all_flows, select
from bench.gpu_e2e.job import Flow
from bench.gpu_e2e.scales import CPU, GPU

FIRST = ["pretrain", "resume-interrupt", "resume-continue", "export-check", "eval-dense", "eval-sparse"]


def test_flows_keep_their_order_at_both_scales():
    names = [f.name for f in all_flows(GPU)]
    assert names[:6] == FIRST and names[-3:] == ["profile-step-dense", "profile-step-sparse", "profile-kernels"]
    assert len(names) == 33 and sum(n.startswith("extend-") for n in names) == 10
    assert "extend-model-sparse-recall-64k" in names  # the recall controller and the dense check
    assert "extend-fresh-sparse-dense-steps-16k" in names  # attention.dense_every
    assert [n for n in names if n.startswith(("chat-", "lora-"))] == [
        "chat-sft-sparse", "lora-sparse", "lora-export-eval", "lora-adapter-eval"
    ]  # fmt: skip
    for family in ("llama3", "qwen3"):
        assert [n for n in names if n.startswith(f"{family}-")] == [
            f"{family}-{step}" for step in ("model", "extend-dense", "extend-sparse", "eval-sparse", "export-check")
        ]
    assert [f.name for f in all_flows(CPU)] == [n.replace("-16k", "-512").replace("-64k", "-1k") for n in names]


def test_a_selection_adds_prerequisites_in_flow_order():
    flows = all_flows(GPU)
    assert [f.name for f in select(flows, "eval-sparse")] == [*FIRST[:3], "eval-sparse"]
    assert [f.name for f in select(flows, "extend-fresh-*-16k")] == [
        "extend-fresh-dense-16k",
        "extend-fresh-sparse-16k",
        "extend-fresh-sparse-dense-steps-16k",
    ]
    assert [f.name for f in select(flows, "extend-model-sparse-64k")] == ["pretrain", "extend-model-sparse-64k"]
    assert [f.name for f in select(flows, "qwen3-eval-sparse")] == [
        "qwen3-model",
        "qwen3-extend-sparse",
        "qwen3-eval-sparse",
    ]
    with pytest.raises(SystemExit, match="no flow matches 'nope'"):
        select(flows, "nope")


def test_a_flow_before_its_prerequisite_is_refused(monkeypatch):
    def late(scale):
        return [Flow("early", "eval", "needs a later flow", lambda job, rec: None, ("profile-kernels",))]

    monkeypatch.setattr(registry, "GROUPS", (late, *registry.GROUPS))
    with pytest.raises(AssertionError, match="early runs before its prerequisites"):
        all_flows(GPU)

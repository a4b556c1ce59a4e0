"""The flows, in the order they run. Each module's builder returns its flows at a scale; a flow runs after its
prerequisites (`Flow.deps`, which must come earlier here), and one left without time or a passed prerequisite is
skipped with the reason.

Adding a flow: a function `run(job, rec)` that launches its commands with `job.run(rec, cmd, rec.timeout_s)` and
ends with `checks.finish(rec, problems, checks)`, a `Flow(name, kind, description, run, deps)` for it in a builder
(a module of its own for a group of flows), and that builder in GROUPS below. `kind` names a timeout of the scales
(scales.py); the files of earlier flows are in `job.state` (data files; the run directory of each training flow
that passed, by flow name).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from bench.gpu_e2e.flows import evaluate, families, finetune, profile, resume, train
from bench.gpu_e2e.job import Flow
from bench.gpu_e2e.scales import Scale

GROUPS: tuple[Callable[[Scale], list[Flow]], ...] = (
    train.pretrain_flows,
    resume.flows,
    evaluate.flows,
    train.extend_flows,
    families.flows,
    finetune.flows,
    profile.flows,
)


def all_flows(scale: Scale) -> list[Flow]:
    flows = [flow for group in GROUPS for flow in group(scale)]
    seen: set[str] = set()
    for flow in flows:
        assert flow.name not in seen, f"two flows named {flow.name}"
        assert all(dep in seen for dep in flow.deps), f"{flow.name} runs before its prerequisites {flow.deps}"
        seen.add(flow.name)
    return flows


def select(flows: list[Flow], spec: str | None) -> list[Flow]:
    """--flows a,b,...: those flows and, transitively, their prerequisites, in the order of `flows`."""
    if not spec or spec == "all":
        return flows
    by_name = {f.name: f for f in flows}
    wanted: set[str] = set()
    stack = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        matches = [n for n in by_name if n == item or re.fullmatch(item.replace("*", ".*"), n)]
        if not matches:
            raise SystemExit(f"--flows: no flow matches {item!r}; flows: {', '.join(by_name)}")
        stack += matches
    while stack:
        name = stack.pop()
        if name not in wanted:
            wanted.add(name)
            stack += list(by_name[name].deps)
    return [f for f in flows if f.name in wanted]

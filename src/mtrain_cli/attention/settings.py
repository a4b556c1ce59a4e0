"""The attention settings: the recipe's `attention` section, and what the sparse planner and kernels read.

Torch-free, so the config loader can build and validate it without importing the model stack. Every bad
value is a `UserError` whose one line names the field, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mtrain_cli.errors import UserError

AttentionMode = Literal["dense", "sparse"]
ATTENTION_MODES: tuple[str, ...] = get_args(AttentionMode)  # what training and eval run


@dataclass(frozen=True)
class AttentionConfig:
    """Dense SDPA, or dynamic vertical-slash sparse attention (pattern re-estimated every step, every layer).

    Frozen: plan caches and the CUDA-graph key hold it."""

    mode: AttentionMode = "dense"
    pattern: Literal["flex", "budget"] = "flex"  # flex: smallest sets holding share p of the probe mass (capped
    # at `cap`); budget: fixed counts
    p: float = 0.96  # flex: share of probe mass the verticals (and, separately, the slashes) must hold; 0.96 with
    # 512 probe queries held every model's quality floor in the frontier (docs/results.md, "The defaults")
    cap: int = 4096  # flex: most verticals / slashes per head (sinks and local window come on top)
    num_vertical: int = 1024  # budget: verticals per head besides the sinks
    num_slash: int = 1024  # budget: slash offsets per head besides the local window
    last_q: int = 512  # probe queries of each long document: more of them made plans sparser and closer to dense
    probe_windows: int = 16  # windows the last_q probe queries form, spread along the document, the last at its
    # end: queries far from the end attend keys its last queries do not (docs/results.md, "Probe windows")
    block_size: int = 64  # layout block = kernel tile; 64 on GPU (bench/results/kernels_h100.md)
    num_sink: int = 4  # first tokens of each long document, always vertical
    local_window: int = 128  # most recent offsets 0..local_window-1, always slash (>= 1: a query sees itself)
    dense_below: int = 8192  # documents shorter than this attend densely within their own blocks
    max_probe_rows: int = 2048  # probe rows per packed row when it holds many long documents (4 x last_q)
    crossover: bool = True  # GPU training: a layer whose plan is above the measured crossover runs dense that step
    dense_layers: tuple[int, ...] = ()  # decoder layers that always run dense: a layer whose attention is broad
    # keeps little of its mass at any sparse cost (bench/extension/results/cap_sweep_layer0_cpu.md)
    recall_target: float | None = None  # training: each layer's and head's kept share and cap adapt so that its
    # probe recall holds this (attention/recall_control.py); None: the fixed p and cap
    max_density: float = 0.5  # with recall_target: a layer whose plan computes more of the causal blocks runs
    # dense for a few steps (route dense-recall)
    dense_every: int = 0  # training, sparse mode: every this many steps one step runs every layer dense (route
    # dense-step): the keys its plans leave out get a gradient too; 0: never
    check_every: int = 50  # training, sparse mode: every this many steps one extra forward of the step's batch with
    # dense attention (no grad) measures what sparse attention costs the loss; 0: never
    check_warn: float = 0.01  # warn when the dense check's mean loss gap over its last 3 checks passes this (nats:
    # about the relative perplexity gap)

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise UserError(f"attention.p {self.p} must be in (0, 1]: the share of probe attention mass to keep")
        if self.block_size not in (16, 32, 64, 128):
            raise UserError(f"attention.block_size {self.block_size} must be 16, 32, 64 or 128 (64 on GPU)")
        for name in ("cap", "last_q", "probe_windows", "local_window", "max_probe_rows"):
            if getattr(self, name) < 1:
                raise UserError(f"attention.{name} {getattr(self, name)} must be >= 1")
        for name in ("num_vertical", "num_slash", "num_sink", "dense_below"):
            if getattr(self, name) < 0:
                raise UserError(f"attention.{name} {getattr(self, name)} must be >= 0")
        if self.probe_windows > self.last_q:
            raise UserError(
                f"attention.probe_windows {self.probe_windows} must be at most attention.last_q {self.last_q}: "
                "each window needs a probe query"
            )
        if self.recall_target is not None:
            if not 0.0 < self.recall_target < 1.0:
                raise UserError(
                    f"attention.recall_target {self.recall_target} must be in (0, 1): the share of probe attention "
                    "mass each head must keep (e.g. 0.95), or null for the fixed attention.p"
                )
            if self.pattern != "flex":
                raise UserError(
                    f"attention.recall_target {self.recall_target} adapts the flex rule's share and cap: set "
                    "attention.pattern=flex, or attention.recall_target=null"
                )
        if not 0.0 < self.max_density <= 1.0:
            raise UserError(f"attention.max_density {self.max_density} must be in (0, 1]: the densest sparse layer")
        if self.dense_every < 0:
            raise UserError(f"attention.dense_every {self.dense_every} must be >= 0 (0: no dense steps)")
        if self.check_every < 0:
            raise UserError(f"attention.check_every {self.check_every} must be >= 0 (0: no dense check)")
        if self.check_warn <= 0:
            raise UserError(f"attention.check_warn {self.check_warn} must be > 0: the loss gap (nats) that warns")
        if any(layer < 0 for layer in self.dense_layers):
            raise UserError(f"attention.dense_layers {list(self.dense_layers)} must hold decoder layer indices >= 0")

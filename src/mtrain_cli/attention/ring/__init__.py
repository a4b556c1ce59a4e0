"""Sparse (or dense) ring attention over context-parallel ranks, flat or hierarchical, planned by the same
estimator as one process. The public face: plan a layer's ring once per forward (`plan_ring`), run it
(`ring_attention`); the dense ring's plan is made once per batch (`plan_dense_ring`)."""

from mtrain_cli.attention.ring.cp_attention import (
    dense_pattern,
    global_documents,
    plan_dense_ring,
    plan_density,
    plan_ring,
    ring_attention,
)
from mtrain_cli.attention.ring.ring import DIRECT, RingPlan, StepRunner

__all__ = [
    "DIRECT",
    "RingPlan",
    "StepRunner",
    "dense_pattern",
    "global_documents",
    "plan_dense_ring",
    "plan_density",
    "plan_ring",
    "ring_attention",
]

"""Sparse (or dense) ring attention over context-parallel ranks, flat or hierarchical, planned by the same
estimator as one process. The public face: plan a layer's ring once per forward (`plan_ring`), run it
(`ring_attention`)."""

from mtrain_cli.attention.ring.cp_attention import dense_pattern, plan_density, plan_ring, ring_attention
from mtrain_cli.attention.ring.ring import DIRECT, RingPlan, StepRunner

__all__ = ["DIRECT", "RingPlan", "StepRunner", "dense_pattern", "plan_density", "plan_ring", "ring_attention"]

"""Flex limits that hold recall: per layer and head, the kept share and the cap follow `attention.recall_target`.

Every plan measures its recall, the share of the probe rows' attention mass that its layout computes (one number
per head). A fixed share p loses what a layer, head and length need differently (layer 0 of a code model keeps
0.73 at p = 0.9 and 256K while the others keep 0.93–0.97), so the controller adapts each head's limits from step
to step:
- kept share: with m the head's missed mass (1 - recall) and m* = 1 - target, the dropped share 1 - keep is
  multiplied by sqrt(m* / m), kept within [1 - KEEP_MAX, 1 - p]: a head short of its target keeps more at once
  (the dropped share at most halves), one above it gives that back slowly (at most RELAX times the dropped share
  an update: recall falls off a cliff where the share stops covering a strong column), never below `attention.p`.
  The probe rows' recall overstates what a head's other queries keep, the more so the smaller its share (a run
  whose heads went down to 0.6 held 0.97 on the probe rows and lost more than p = 0.9: docs/results.md, "What the
  gap is"), so the target only adds to p;
- cap: a head short of its target whose chosen entries reached its cap doubles it (up to the sequence length):
  a fixed cap of 4,096 binds at 128K and beyond; a head using under a quarter of its cap halves it, never below
  `attention.cap`;
- density ceiling: a layer whose plan computed more than `attention.max_density` of the causal blocks runs dense
  for the next DENSE_STEPS steps (route `dense-recall`, counted), then is planned again.

Determinism: steps run one ahead (step s is launched before step s - 1 is read), so step s uses the observations
of steps up to s - 2, whatever the loop did; the state (limits and the observations not yet applied) is saved in
checkpoints, and observations are the same on every rank (the trainer averages them over the ranks), so a resumed
run, on any number of processes, routes and limits every layer as the uninterrupted run does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mtrain_cli.attention.settings import AttentionConfig

if TYPE_CHECKING:
    import torch

    from mtrain_cli.attention.sparse.pattern import FlexLimits

KEEP_MAX = 0.9995
TIGHTEN, RELAX = 0.5, 1.25  # the most a head's dropped share changes by in one update, down and up
DENSE_STEPS = 8  # steps a layer above the density ceiling runs dense before it is planned again
LAG = 2  # step s uses the observations of steps <= s - LAG


@dataclass
class LayerObservation:
    """One step's plans of a layer, over every rank: per head the mean recall and the most entries chosen beyond the
    forced ones; the mean density."""

    recall_H: list[float]
    chosen_H: list[int]
    density: float


def layer_observations(
    by_head: dict[int, tuple[list[float], list[float], int]],
    by_layer: dict[str, list[float]],
    num_layers: int,
    num_heads: int,
    distributed: bool,
) -> dict[int, LayerObservation]:
    """A read step's plan records (`by_head`: layer -> per head recall, per head entries chosen, plans made;
    `by_layer`: str(layer) -> [.., density]) as the controller's observations, averaged over every rank when
    `distributed`: dp ranks planned other batches, and a rank may have planned a layer another ran dense."""
    import torch
    import torch.distributed as dist

    sums_LX = torch.zeros(num_layers, num_heads + 2, dtype=torch.float64)  # recall per head, density, plans
    most_LH = torch.zeros(num_layers, num_heads, dtype=torch.float64)  # entries chosen per head
    for layer, (recall_H, chosen_H, num_plans) in by_head.items():
        sums_LX[layer, :num_heads] = torch.tensor(recall_H, dtype=torch.float64) * num_plans
        sums_LX[layer, num_heads] = by_layer[str(layer)][1] * num_plans
        sums_LX[layer, num_heads + 1] = num_plans
        most_LH[layer] = torch.tensor(chosen_H, dtype=torch.float64)
    if distributed:  # CPU tensors: the trainer's gloo group
        dist.all_reduce(sums_LX)
        dist.all_reduce(most_LH, op=dist.ReduceOp.MAX)
    observations = {}
    for layer in range(num_layers):
        num_plans = float(sums_LX[layer, num_heads + 1])
        if num_plans:
            observations[layer] = LayerObservation(
                (sums_LX[layer, :num_heads] / num_plans).tolist(),
                [int(c) for c in most_LH[layer].tolist()],
                float(sums_LX[layer, num_heads]) / num_plans,
            )
    return observations


class RecallController:
    """The flex limits of every layer and head over a run (the attention router asks it per layer and step)."""

    def __init__(self, settings: AttentionConfig):
        assert settings.recall_target is not None and settings.pattern == "flex"
        self.settings = settings
        self.step = 0  # the step being launched
        self.keep: dict[int, list[float]] = {}  # layer -> per head kept share (settings.p until observed)
        self.cap: dict[int, list[int]] = {}  # layer -> per head cap (settings.cap until observed)
        self.dense_until: dict[int, int] = {}  # layer -> first step it is planned again
        self.pending: list[tuple[int, dict[int, LayerObservation]]] = []  # (step, observations), not yet applied
        self._on_device: dict[tuple[int, int, int, str], FlexLimits] = {}  # made once per change

    # -- the router's side ---------------------------------------------------------------------
    def runs_dense(self, layer: int | None) -> bool:
        """The layer is in a dense stretch: its last plan passed the density ceiling."""
        return layer is not None and self.step < self.dense_until.get(layer, 0)

    def limits(self, layer: int | None, num_heads: int, seq_len: int, device: torch.device) -> FlexLimits | None:
        """The layer's limits for this step (None: a module without a layer index takes the settings')."""
        if layer is None:
            return None
        key = (layer, num_heads, seq_len, str(device))
        if key not in self._on_device:
            import torch

            from mtrain_cli.attention.sparse.pattern import FlexLimits

            keep = self.keep.get(layer, [self.settings.p] * num_heads)
            cap = [min(c, seq_len) for c in self.cap.get(layer, [self.settings.cap] * num_heads)]
            # a power of two: the plan graph's shapes (and so its captures) change only when a cap passes one
            width = min(seq_len, 1 << (max(cap) - 1).bit_length())
            keep_H = torch.tensor(keep, dtype=torch.float32).to(device, non_blocking=True)
            cap_H = torch.tensor(cap, dtype=torch.int64).to(device, non_blocking=True)
            self._on_device[key] = FlexLimits(keep_H, cap_H, width)
        return self._on_device[key]

    # -- the trainer's side --------------------------------------------------------------------
    def start_step(self, step: int) -> None:
        """Before launching `step`: apply the observations of steps <= step - LAG, in step order."""
        self.step = step
        due = [entry for entry in self.pending if entry[0] <= step - LAG]
        if due:
            self.pending = [entry for entry in self.pending if entry[0] > step - LAG]
            for observed_step, observations in due:
                self._apply(observed_step + LAG, observations)
            self._on_device.clear()

    def observe(self, step: int, observations: dict[int, LayerObservation]) -> None:
        """A read step's observations (the same on every rank), applied when step + LAG is launched."""
        if observations:
            self.pending.append((step, observations))

    def _apply(self, at_step: int, observations: dict[int, LayerObservation]) -> None:
        target_miss = 1.0 - self.settings.recall_target
        for layer, seen in sorted(observations.items()):
            num_heads = len(seen.recall_H)
            keep = self.keep.setdefault(layer, [self.settings.p] * num_heads)
            cap = self.cap.setdefault(layer, [self.settings.cap] * num_heads)
            for h, (recall, chosen) in enumerate(zip(seen.recall_H, seen.chosen_H)):
                miss = max(1.0 - recall, 1e-6)
                factor = min(max(math.sqrt(target_miss / miss), TIGHTEN), RELAX)
                dropped = min(max((1.0 - keep[h]) * factor, 1.0 - KEEP_MAX), 1.0 - self.settings.p)
                keep[h] = 1.0 - dropped
                if recall < self.settings.recall_target and chosen >= cap[h]:
                    cap[h] *= 2
                elif 4 * chosen < cap[h]:
                    cap[h] = max(cap[h] // 2, self.settings.cap)
            if seen.density > self.settings.max_density:
                self.dense_until[layer] = at_step + DENSE_STEPS

    def summary(self) -> dict[str, Any]:
        """For the step line and summary.json: mean kept share and cap over the heads seen, the layers in a dense
        stretch now."""
        keeps = [k for heads in self.keep.values() for k in heads]
        caps = [c for heads in self.cap.values() for c in heads]
        return {
            "recall_target": self.settings.recall_target,
            "keep_mean": sum(keeps) / len(keeps) if keeps else self.settings.p,
            "keep_min": min(keeps, default=self.settings.p),
            "cap_mean": sum(caps) / len(caps) if caps else self.settings.cap,
            "cap_max": max(caps, default=self.settings.cap),
            "dense_layers_now": sorted(layer for layer in self.dense_until if self.runs_dense(layer)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "keep": {layer: list(v) for layer, v in self.keep.items()},
            "cap": {layer: list(v) for layer, v in self.cap.items()},
            "dense_until": dict(self.dense_until),
            "pending": [
                (step, {layer: vars(seen).copy() for layer, seen in observations.items()})
                for step, observations in self.pending
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What `state_dict` saved; {} (a checkpoint of a run without the controller) starts from the settings."""
        if not state:
            return
        self.keep = {int(layer): list(v) for layer, v in state["keep"].items()}
        self.cap = {int(layer): list(v) for layer, v in state["cap"].items()}
        self.dense_until = {int(layer): step for layer, step in state["dense_until"].items()}
        self.pending = [
            (step, {int(layer): LayerObservation(**seen) for layer, seen in observations.items()})
            for step, observations in state["pending"]
        ]
        self._on_device.clear()

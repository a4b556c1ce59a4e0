"""Context extension recipes written into a Hugging Face config with transformers' own keys.

`yarn`: NTK-by-parts interpolation (YaRN, arXiv 2309.00071). For RoPE dimension pair i with wavelength
λ_i = 2π·θ^(2i/d), let r_i = L_orig / λ_i be how many full turns it makes over the original context:
  r_i > β_fast  -> high frequency, kept as is (extrapolated: it has already seen every phase);
  r_i < β_slow  -> low frequency, interpolated fully (frequency divided by the factor s);
  in between    -> a linear blend of the two.
Attention logits are scaled through cos/sin by the attention factor (default 0.1·ln s + 1).
`theta`: change the RoPE base (ABF / "NTK by base change", as Llama-3 and ProLong do).

transformers v5 keeps these in `config.rope_parameters`; we set both `factor` and
`max_position_embeddings = factor × original` so nothing re-derives a different factor (#38224).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mtrain_cli.config import ContextConfig
from mtrain_cli.errors import UserError


def model_rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def apply_context_extension(hf_config, context: ContextConfig) -> None:
    """Rewrite the RoPE settings of `hf_config` in place according to the recipe."""
    if context.method == "none":
        return
    existing = dict(getattr(hf_config, "rope_parameters", None) or {})
    if existing.get("rope_type", "default") not in ("default", None):
        raise UserError(
            f"context.method {context.method}: the model already uses rope_type "
            f"{existing['rope_type']!r}; extend from a model with plain RoPE or set context.method=none"
        )
    original = context.original_max_position_embeddings or hf_config.max_position_embeddings
    theta = context.rope_theta if context.rope_theta is not None else model_rope_theta(hf_config)
    if context.method == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(context.factor),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(context.beta_fast),
            "beta_slow": float(context.beta_slow),
        }
        if context.attention_factor is not None:
            params["attention_factor"] = float(context.attention_factor)
    else:  # theta
        params = {"rope_type": "default", "rope_theta": theta}
    hf_config.rope_parameters = params
    hf_config.max_position_embeddings = round(context.factor * original)


@dataclass
class RopeSummary:
    method: str
    rope_theta: float
    factor: float
    original_context: int
    extended_context: int
    attention_factor: float
    num_dims: int  # rotary frequency pairs
    num_kept: int  # extrapolated (high frequency) pairs
    num_blended: int
    num_interpolated: int
    shortest_interpolated_wavelength: float | None


def rope_summary(hf_config) -> RopeSummary:
    """The numbers a user wants to see before spending GPU hours on a recipe."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    theta = float(params.get("rope_theta", 10000.0))
    num_dims = head_dim // 2
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(num_dims)]
    if params.get("rope_type") != "yarn":
        ctx = hf_config.max_position_embeddings
        # plain RoPE (context.method none or theta): the config alone cannot tell whether θ was changed
        return RopeSummary(
            params.get("rope_type", "default"), theta, 1.0, ctx, ctx, 1.0, num_dims, num_dims, 0, 0, None
        )
    factor = float(params["factor"])
    original = int(params["original_max_position_embeddings"])
    beta_fast, beta_slow = float(params.get("beta_fast", 32)), float(params.get("beta_slow", 1))
    attention_factor = params.get("attention_factor") or (0.1 * math.log(factor) + 1.0)
    rotations = [original / w for w in wavelengths]
    kept = sum(r > beta_fast for r in rotations)
    interpolated = [w for w, r in zip(wavelengths, rotations) if r < beta_slow]
    return RopeSummary(
        method="yarn",
        rope_theta=theta,
        factor=factor,
        original_context=original,
        extended_context=hf_config.max_position_embeddings,
        attention_factor=float(attention_factor),
        num_dims=num_dims,
        num_kept=kept,
        num_blended=num_dims - kept - len(interpolated),
        num_interpolated=len(interpolated),
        shortest_interpolated_wavelength=min(interpolated) if interpolated else None,
    )

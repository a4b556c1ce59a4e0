"""Context extension recipes written into a Hugging Face config with transformers' own keys.

A model starts from plain RoPE (`default`), from Llama 3.x's `llama3` scaling or from YaRN, and
context.method says how its context grows by context.factor s:

`yarn`: NTK-by-parts interpolation (YaRN, arXiv 2309.00071). For RoPE dimension pair i with wavelength
λ_i = 2π·θ^(2i/d), let r_i = L / λ_i be how many full turns it makes over the pretraining context L:
  r_i > β_fast  -> high frequency, kept as is (extrapolated: it has already seen every phase);
  r_i < β_slow  -> low frequency, interpolated fully (frequency divided by the YaRN factor);
  in between    -> a linear blend of the two.
Attention logits are scaled through cos/sin by the attention factor (default 0.1·ln factor + 1).
From plain RoPE, L is the model's context and the YaRN factor is s. From `llama3` (Llama 3.1: factor 8
over L = 8,192, bands 1–4, context 131,072) YaRN replaces llama3 from L with factor s·context/L and llama3's
own bands as β (the choice of NVIDIA's UltraLong, Llama-3.1-8B 128K → 1M–4M): frequencies between the bands
and the attention scale change, which the run says loudly. From `yarn` the factor is multiplied by s.
`llama3`: keep Llama 3.x's scaling and multiply its factor by s (bands and L unchanged).
`theta`: a new RoPE base under whatever scaling the model has (ABF / "NTK by base change", as ProLong did).

transformers v5 keeps these in `config.rope_parameters` and computes the frequencies with
`ROPE_INIT_FUNCTIONS[rope_type]`; we set both `factor` and `max_position_embeddings` so nothing re-derives a
different factor (#38224).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtrain_cli.errors import UserError
from mtrain_cli.families import FAMILIES

if TYPE_CHECKING:
    from mtrain_cli.config import ContextConfig

STARTING_TYPES = ("default", "llama3", "yarn")  # the RoPE a model may start from
SCALING_KEYS = {  # what a fresh model's model.rope_scaling must hold, by rope_type (as in a config.json)
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_YARN_KEEP = ("attention_factor", "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor")


def rope_parameters(hf_config) -> dict:
    """The model's RoPE settings as transformers v5 reads them (rope_type, rope_theta and the scaling keys)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    return params


def check_rope_scaling(scaling: dict, field: str) -> None:
    """A `rope_scaling` mapping as a config.json holds it: a rope_type mtrain starts from, with its keys."""
    rope_type = scaling.get("rope_type")
    if rope_type not in SCALING_KEYS:
        raise UserError(
            f"{field}.rope_type {rope_type!r} is not one of {', '.join(SCALING_KEYS)}; leave {field} null for "
            f"plain RoPE"
        )
    missing = [key for key in SCALING_KEYS[rope_type] if key not in scaling]
    if missing:
        raise UserError(f"{field} ({rope_type}) lacks {', '.join(missing)}; copy them from the model's config.json")


def check_family_rope(model_type: str, rope_type: str, label: str, fix: str) -> None:
    """A family whose config reads some rope_types otherwise (families.py: `rope_types`) trains only with its own:
    Phi3Config turns yarn into its longrope, and longrope picks its frequencies per sequence length, which
    differs between the ranks of a ring."""
    family = FAMILIES.get(model_type)
    if family is not None and family.rope_types is not None and rope_type not in family.rope_types:
        raise UserError(
            f"{label}: mtrain runs {family.name} models with rope_type {' or '.join(family.rope_types)} only, "
            f"not {rope_type}; {fix}"
        )


def apply_context_extension(hf_config, context: ContextConfig, label: str | None = None) -> list[str]:
    """Rewrite the RoPE settings of `hf_config` in place according to the recipe. -> what the user must know
    (frequencies that change beyond the extension itself), to be shown as warnings. `label` names the option
    in errors (default: context.method)."""
    label = label or f"context.method {context.method}"
    start = rope_parameters(hf_config)
    start_type = start["rope_type"]
    check_family_rope(hf_config.model_type, start_type, label, "use one with plain RoPE")
    if context.method == "none":
        return []
    if start_type not in STARTING_TYPES:
        raise UserError(
            f"{label}: the model uses rope_type {start_type!r}; mtrain extends models with plain RoPE "
            f"(default), llama3 or yarn scaling; use it without extension (context.method=none, no --yarn)"
        )
    before = context.original_max_position_embeddings or hf_config.max_position_embeddings
    target = round(context.factor * before)
    theta = float(context.rope_theta) if context.rope_theta is not None else float(start["rope_theta"])
    notes: list[str] = []
    if context.method == "theta":
        params = {**start, "rope_theta": theta}
    elif context.method == "llama3":
        if start_type != "llama3":
            raise UserError(
                f"{label}: the model uses rope_type {start_type!r}, not llama3; raise its context with "
                f"context.method yarn or theta"
            )
        params = {**start, "rope_theta": theta, "factor": float(start["factor"]) * context.factor}
    else:  # yarn
        pretrained = before if start_type == "default" else int(start["original_max_position_embeddings"])
        beta_fast = {"llama3": start.get("high_freq_factor"), "yarn": start.get("beta_fast")}.get(start_type)
        beta_slow = {"llama3": start.get("low_freq_factor"), "yarn": start.get("beta_slow")}.get(start_type)
        params = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": float(context.factor * before / pretrained),
            "original_max_position_embeddings": int(pretrained),
            "beta_fast": float(_first(context.beta_fast, beta_fast, 32.0)),
            "beta_slow": float(_first(context.beta_slow, beta_slow, 1.0)),
        }
        if start_type == "yarn":
            params.update({key: start[key] for key in _YARN_KEEP if key in start})
        if context.attention_factor is not None:
            params["attention_factor"] = float(context.attention_factor)
        if start_type == "llama3":
            scale = params.get("attention_factor") or 0.1 * math.log(params["factor"]) + 1.0
            notes.append(
                f"{label} replaces the model's llama3 RoPE scaling (factor {float(start['factor']):g} over "
                f"{pretrained:,} tokens, bands {float(start['low_freq_factor']):g}–"
                f"{float(start['high_freq_factor']):g}) by YaRN ×{params['factor']:g} over {pretrained:,} with "
                f"β_slow {params['beta_slow']:g}, β_fast {params['beta_fast']:g}: the blended band's frequencies "
                f"change and attention logits are scaled by {scale**2:.3f} (YaRN's attention factor {scale:.4f} on "
                f"q and k); set context.method=llama3 to keep llama3's scaling"
            )
    check_family_rope(hf_config.model_type, params["rope_type"], label, "extend it with context.method=theta")
    hf_config.rope_parameters = params
    hf_config.max_position_embeddings = target
    return notes


def _first(*values):
    return next(value for value in values if value is not None)


def describe_rope(hf_config) -> str:
    """One line: 'llama3: θ=500000, factor 8 over 8,192 → 131,072 tokens'."""
    params = rope_parameters(hf_config)
    line = f"{params['rope_type']}: θ={float(params['rope_theta']):g}"
    if "factor" in params:
        line += f", factor {float(params['factor']):g} over {int(params['original_max_position_embeddings']):,}"
    return f"{line} → {hf_config.max_position_embeddings:,} tokens"


@dataclass
class RopeSummary:
    method: str  # the rope_type transformers computes the frequencies with
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
    """The numbers a user wants to see before spending GPU hours on a recipe: the bands are read off the inverse
    frequencies transformers computes from the config (ROPE_INIT_FUNCTIONS), i.e. the ones the model trains with."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(hf_config)
    rope_type, theta = params["rope_type"], float(params["rope_theta"])
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    base_BD = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    num_dims = len(base_BD)
    ctx = hf_config.max_position_embeddings
    if rope_type not in ROPE_INIT_FUNCTIONS or "factor" not in params:
        # plain RoPE (context.method none or theta): the config alone cannot tell whether θ was changed
        return RopeSummary(rope_type, theta, 1.0, ctx, ctx, 1.0, num_dims, num_dims, 0, 0, None)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    factor = float(params["factor"])
    ratio = base_BD / inv_freq.double()  # 1: kept, factor: interpolated
    kept = torch.isclose(ratio, torch.ones_like(ratio), rtol=1e-4)
    interpolated = torch.isclose(ratio, torch.full_like(ratio, factor), rtol=1e-4)
    wavelengths = 2 * math.pi / base_BD[interpolated]
    return RopeSummary(
        method=rope_type,
        rope_theta=theta,
        factor=factor,
        original_context=int(params["original_max_position_embeddings"]),
        extended_context=ctx,
        attention_factor=float(attention_factor),
        num_dims=num_dims,
        num_kept=int(kept.sum()),
        num_blended=int((~kept & ~interpolated).sum()),
        num_interpolated=int(interpolated.sum()),
        shortest_interpolated_wavelength=float(wavelengths.min()) if len(wavelengths) else None,
    )

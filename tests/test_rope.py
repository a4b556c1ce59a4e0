"""The context-extension recipe lands in the HF config with transformers' keys, and the model's rotary
frequencies equal YaRN computed here from the paper (arXiv 2309.00071, NTK-by-parts), not from transformers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from mtrain_cli.config import ContextConfig, load_config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.rope import apply_context_extension, rope_summary


def yarn_by_hand(
    head_dim: int, theta: float, factor: float, original: int, beta_fast: float = 32.0, beta_slow: float = 1.0
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling), straight from the paper's definitions.

    Pair i rotates at θ^(-2i/d) rad/token; over the original context it makes r_i = L·θ^(-2i/d)/(2π) turns.
    The dimension where r = β is d·ln(L/(2πβ))/(2 ln θ); the ramp runs from floor(dim at β_fast) to
    ceil(dim at β_slow). Below the ramp: original frequency; above: frequency / factor; linear in between."""
    num_pairs = head_dim // 2
    dim_at = lambda turns: head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low = max(math.floor(dim_at(beta_fast)), 0)
    high = min(math.ceil(dim_at(beta_slow)), head_dim - 1)
    inv_freq = []
    for i in range(num_pairs):
        extrapolated = theta ** (-2 * i / head_dim)
        ramp = min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0)  # 0: keep, 1: interpolate
        inv_freq.append(extrapolated * (1 - ramp) + extrapolated / factor * ramp)
    return torch.tensor(inv_freq, dtype=torch.float64), 0.1 * math.log(factor) + 1.0


CASES = [
    pytest.param(
        Qwen2Config,
        Qwen2RotaryEmbedding,
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            max_position_embeddings=32768,
        ),
        16.0,
        id="qwen2.5-3b-shape",
    ),
    pytest.param(
        LlamaConfig,
        LlamaRotaryEmbedding,
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            max_position_embeddings=8192,
        ),
        8.0,
        id="llama-3-8b-shape",
    ),
    pytest.param(
        Qwen2Config,
        Qwen2RotaryEmbedding,
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
            max_position_embeddings=256,
        ),
        8.0,
        id="tiny-recipe-shape",
    ),
]


@pytest.mark.parametrize("config_class, rotary_class, fields, factor", CASES)
def test_yarn_frequencies_match_the_paper(config_class, rotary_class, fields, factor):
    hf_config = config_class(**fields)
    original = hf_config.max_position_embeddings
    theta = hf_config.rope_parameters["rope_theta"]
    apply_context_extension(hf_config, ContextConfig(method="yarn", factor=factor))

    params = hf_config.rope_parameters
    assert params["rope_type"] == "yarn" and params["factor"] == factor
    assert params["original_max_position_embeddings"] == original and params["rope_theta"] == theta
    assert hf_config.max_position_embeddings == factor * original

    rotary = rotary_class(hf_config)
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    expected_inv_freq, expected_scaling = yarn_by_hand(head_dim, theta, factor, original)
    torch.testing.assert_close(rotary.inv_freq.double(), expected_inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(expected_scaling, rel=1e-9)
    # The extremes: the fastest pair is untouched, the slowest one is fully interpolated.
    assert rotary.inv_freq[0].item() == pytest.approx(1.0)
    assert rotary.inv_freq[-1].item() == pytest.approx(theta ** (-(head_dim - 2) / head_dim) / factor, rel=1e-5)

    summary = rope_summary(hf_config)
    assert summary.num_kept + summary.num_blended + summary.num_interpolated == head_dim // 2
    assert summary.extended_context == factor * original and summary.attention_factor == pytest.approx(expected_scaling)


def test_theta_method_changes_only_the_base():
    hf_config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    apply_context_extension(hf_config, ContextConfig(method="theta", factor=4, rope_theta=1e6))
    assert hf_config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert hf_config.max_position_embeddings == 4096
    rotary = LlamaRotaryEmbedding(hf_config)
    expected = 1e6 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(rotary.inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_already_scaled_models_are_refused():
    hf_config = Qwen2Config(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    with pytest.raises(UserError, match="already uses rope_type 'yarn'"):
        apply_context_extension(hf_config, ContextConfig(method="yarn", factor=2))


def test_the_trained_model_carries_the_recipe():
    """End to end through the recipe: the built model's own rotary module has the YaRN frequencies."""
    config = load_config("tiny")
    model = build_model(config, load_tokenizer(config), torch.device("cpu"))
    rotary = model.model.rotary_emb
    expected_inv_freq, expected_scaling = yarn_by_hand(32, 10000.0, 8.0, 256)
    torch.testing.assert_close(rotary.inv_freq.double(), expected_inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(expected_scaling)
    assert model.config.max_position_embeddings == 2048

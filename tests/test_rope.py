"""The context-extension recipe lands in the HF config with transformers' keys, and the model's rotary
frequencies equal YaRN computed here from the paper (arXiv 2309.00071, NTK-by-parts) and llama3 scaling from
Meta's reference, not from transformers; for every method and starting RoPE (plain, raised θ, llama3, yarn),
the exported config.json makes plain transformers compute exactly the frequencies and scaling mtrain trained
with."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from mtrain_cli.config import ContextConfig, load_config
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.model.rope import apply_context_extension, rope_summary
from mtrain_cli.train.export import export_hf


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


def test_starting_points_mtrain_cannot_extend_are_one_line():
    linear = Qwen2Config(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    )
    with pytest.raises(UserError, match="the model uses rope_type 'linear'; mtrain extends models with plain RoPE"):
        apply_context_extension(linear, ContextConfig(method="yarn", factor=2))
    plain = Qwen2Config(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024)
    with pytest.raises(UserError, match="context.method llama3: the model uses rope_type 'default', not llama3"):
        apply_context_extension(plain, ContextConfig(method="llama3", factor=2))


def test_the_trained_model_carries_the_recipe():
    """End to end through the recipe: the built model's own rotary module has the YaRN frequencies."""
    config = load_config("tiny")
    model = build_model(config, load_tokenizer(config), torch.device("cpu"))
    rotary = model.model.rotary_emb
    expected_inv_freq, expected_scaling = yarn_by_hand(32, 10000.0, 8.0, 256)
    torch.testing.assert_close(rotary.inv_freq.double(), expected_inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(expected_scaling)
    assert model.config.max_position_embeddings == 2048


def llama3_by_hand(
    head_dim: int, theta: float, factor: float, low: float, high: float, original: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling 1) of Llama 3.1's scaling, as Meta's reference `apply_scaling` writes it:
    wavelengths under original/high kept, over original/low divided by the factor, a smooth blend between."""
    inv_freq = []
    for i in range(head_dim // 2):
        freq = theta ** (-2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            inv_freq.append(freq)
        elif wavelength > original / low:
            inv_freq.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            inv_freq.append((1 - smooth) * freq / factor + smooth * freq)
    return torch.tensor(inv_freq, dtype=torch.float64), 1.0


LLAMA31 = {  # Llama-3.1-8B's published rope_scaling and theta
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN_QWEN = {  # Qwen2.5-7B-Instruct's documented YaRN for 128K
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 4.0,
    "original_max_position_embeddings": 32768,
}
STARTS = {  # starting RoPE -> (rope_parameters, max_position_embeddings); head_dim 128 as in all of these models
    "llama3": (LLAMA31, 131072),
    "yarn": (YARN_QWEN, 131072),
    "default": ({"rope_type": "default", "rope_theta": 1e6}, 32768),  # Qwen2.5-3B
    "theta": ({"rope_type": "default", "rope_theta": 8e6}, 65536),  # a base already raised (ABF, ProLong's 64K)
}


def expected_frequencies(start: str, method: str, factor: float) -> tuple[torch.Tensor, float, dict]:
    """(inv_freq, attention scaling, the rope_parameters mtrain must write) from the definitions above."""
    params, context = STARTS[start]
    theta = params["rope_theta"]
    if method == "theta":
        theta *= 4
    if method == "yarn":
        original = context if params["rope_type"] == "default" else params["original_max_position_embeddings"]
        betas = {"llama3": (4.0, 1.0), "yarn": (32.0, 1.0)}.get(start, (32.0, 1.0))
        yarn_factor = factor * context / original
        written = {"rope_type": "yarn", "factor": yarn_factor, "original_max_position_embeddings": original}
        return (*yarn_by_hand(128, theta, yarn_factor, original, *betas), written)
    if params["rope_type"] == "llama3":
        scale = params["factor"] * (factor if method == "llama3" else 1.0)
        written = {"rope_type": "llama3", "factor": scale, "rope_theta": theta}
        return (*llama3_by_hand(128, theta, scale, 1.0, 4.0, 8192), written)
    if params["rope_type"] == "yarn":  # theta under yarn
        written = {"rope_type": "yarn", "factor": 4.0, "rope_theta": theta}
        return (*yarn_by_hand(128, theta, 4.0, 32768), written)
    written = {"rope_type": "default", "rope_theta": theta}
    return theta ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128), 1.0, written


METHODS = [
    (start, method)
    for start in STARTS
    for method in ("yarn", "llama3", "theta", "none")
    if method != "llama3" or start == "llama3"
]


@pytest.mark.parametrize("start, method", METHODS)
def test_the_export_makes_transformers_compute_the_frequencies_mtrain_trained_with(start, method, tmp_path):
    """A 1-layer model with the starting RoPE of a real one (head dim 128) is extended 4× by `method`: the rotary
    module mtrain trains equals the paper's / Meta's formulas, and the exported config.json makes transformers'
    own code (the model class and ROPE_INIT_FUNCTIONS) compute exactly the same frequencies and scaling."""
    params, context = STARTS[start]
    tokenizer = load_tokenizer(load_config("tiny"))
    source = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        rope_parameters=dict(params),
    )
    AutoModelForCausalLM.from_config(source).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    overrides = [f"model.path={tmp_path / 'model'}", f"context.method={method}", "context.factor=4"]
    overrides += ["context.rope_theta=" + str(params["rope_theta"] * 4)] if method == "theta" else []
    config = load_config("tiny", overrides)
    model = build_model(config, tokenizer, torch.device("cpu"))
    trained = model.model.rotary_emb

    if method == "none":
        expected_inv_freq, expected_scaling = type(trained).compute_default_rope_parameters(source)
        if params["rope_type"] != "default":
            expected_inv_freq, expected_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](source)
        assert model.config.max_position_embeddings == context
    else:
        expected_inv_freq, expected_scaling, written = expected_frequencies(start, method, 4.0)
        assert written.items() <= model.config.rope_parameters.items()
        assert model.config.max_position_embeddings == 4 * context
    torch.testing.assert_close(trained.inv_freq.double(), expected_inv_freq.double(), rtol=2e-6, atol=0)
    assert trained.attention_scaling == pytest.approx(expected_scaling, rel=1e-9)

    export_hf(model, tokenizer, tmp_path / "export")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", local_files_only=True)
    assert torch.equal(exported.model.rotary_emb.inv_freq, trained.inv_freq)
    assert exported.model.rotary_emb.attention_scaling == trained.attention_scaling
    reloaded = AutoConfig.from_pretrained(tmp_path / "export", local_files_only=True)
    rope_type = reloaded.rope_parameters["rope_type"]
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](reloaded, torch.device("cpu"))
        assert torch.equal(inv_freq, trained.inv_freq) and scaling == trained.attention_scaling
    assert reloaded.max_position_embeddings == model.config.max_position_embeddings


def test_dry_run_shows_the_bands_of_each_method(tmp_path):
    """rope_summary reads the bands off the frequencies: llama3 keeps its own bands under a raised factor;
    YaRN from llama3 uses them as β, so the same pairs are kept and interpolated at a larger factor."""
    config = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=dict(LLAMA31)
    )
    start = rope_summary(config)
    assert (start.method, start.factor, start.original_context, start.attention_factor) == ("llama3", 8.0, 8192, 1.0)
    assert start.num_kept + start.num_blended + start.num_interpolated == 64 and start.num_blended > 0
    by_method = {}
    for method in ("llama3", "yarn"):
        extended = LlamaConfig(**config.to_dict())
        apply_context_extension(extended, ContextConfig(method=method, factor=4))
        by_method[method] = rope_summary(extended)
    llama3, yarn = by_method["llama3"], by_method["yarn"]
    assert (llama3.factor, llama3.extended_context) == (32.0, 524288)
    assert (llama3.num_kept, llama3.num_interpolated) == (start.num_kept, start.num_interpolated)
    assert (yarn.factor, yarn.original_context, yarn.extended_context) == (64.0, 8192, 524288)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(64) + 1)
    # llama3 blends by wavelength, YaRN by dimension (with floor/ceil): the edges may differ by a pair
    assert abs(yarn.num_kept - start.num_kept) <= 1 and abs(yarn.num_interpolated - start.num_interpolated) <= 1

"""The model: a fresh one from the recipe or a local HF directory of a family mtrain extends, with its tokenizer
(build.py); the RoPE context-extension recipes applied to its config (rope.py); small random models of each family
for tests and GPU checks (tiny.py, `python -m mtrain_cli.model.tiny`).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads neither torch nor transformers.
"""

from mtrain_cli.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "build": (
            "build_hf_config",
            "build_model",
            "check_weight_shapes",
            "weight_shape_mismatch",
            "count_parameters",
            "load_hf_config",
            "load_local_weights",
            "load_tokenizer",
        ),
        "rope": ("RopeSummary", "apply_context_extension", "describe_rope", "rope_summary"),
        "tiny": ("save_tiny_model",),
    },
)

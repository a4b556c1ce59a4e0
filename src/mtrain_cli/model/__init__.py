"""The model: a fresh one from the recipe or a local HF directory of a family mtrain extends, with its tokenizer
(build.py); the RoPE context-extension recipes applied to its config (rope.py); small random models of each family
for tests and GPU checks (tiny.py, `python -m mtrain_cli.model.tiny`).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "build_hf_config": "build",
    "build_model": "build",
    "count_parameters": "build",
    "load_hf_config": "build",
    "load_tokenizer": "build",
    "RopeSummary": "rope",
    "apply_context_extension": "rope",
    "describe_rope": "rope",
    "rope_summary": "rope",
    "save_tiny_model": "tiny",
}
__all__ = [  # noqa: RUF022 (the order of _EXPORTS: by module)
    "build_hf_config",
    "build_model",
    "count_parameters",
    "load_hf_config",
    "load_tokenizer",
    "RopeSummary",
    "apply_context_extension",
    "describe_rope",
    "rope_summary",
    "save_tiny_model",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


if TYPE_CHECKING:
    from mtrain_cli.model.build import (
        build_hf_config,
        build_model,
        count_parameters,
        load_hf_config,
        load_tokenizer,
    )
    from mtrain_cli.model.rope import (
        RopeSummary,
        apply_context_extension,
        describe_rope,
        rope_summary,
    )
    from mtrain_cli.model.tiny import save_tiny_model

"""`mtrain eval --attention sparse`: which settings run (an mtrain run's own `attention` section, else the
recipe defaults, then `--sparse-set` overrides), an attention router entered for the run (every layer of a
model loaded with mtrain's attention hook goes through it), and a record of what actually ran (calls per path,
mean probe recall and block density).

The runner prefills each prompt in one forward, so the router sees as many queries as keys and takes the
sparse path; a prompt shorter than `dense_below` has nothing to plan (its layout would be dense) and runs dense
through the router ("dense-short-documents"); decoding (one query against the KV cache) runs dense through the
same router ("dense-decode")."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mtrain_cli.attention import AttentionConfig
from mtrain_cli.config import attention_from_dict
from mtrain_cli.errors import UserError

if TYPE_CHECKING:  # torch: imported once the options are checked
    from mtrain_cli.attention import AttentionRouter

# `crossover` is a training speed rule: eval measures what sparse attention does, so every prefill runs sparse. The
# recall controller and the dense check are training's too: eval plans with the fixed p and cap.
TRAINING_ONLY = ("mode", "crossover", "recall_target", "max_density", "check_every", "check_warn")
SETTING_KEYS = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name not in TRAINING_ONLY)


@dataclass
class SparseRequest:
    config: AttentionConfig  # mode "sparse"
    source: str  # where the settings came from, for results.json
    overrides: list[str] = field(default_factory=list)  # the --sparse-set items, in order

    def settings(self) -> dict[str, Any]:
        """As the results JSON holds them (a tuple setting as a list)."""
        values = {key: getattr(self.config, key) for key in SETTING_KEYS}
        return {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}


def _checked(raw: dict[str, Any], what: str) -> AttentionConfig:
    """The recipe's own coercion and validation of the `attention` section; errors name `what`."""
    try:
        return attention_from_dict(raw)
    except UserError as exc:
        raise UserError(f"{what}: {exc}") from None


def _override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise UserError(f"--sparse-set {item!r} must look like key=value, e.g. --sparse-set p=0.95")
    key, _, text = item.partition("=")
    key = key.strip()
    if key == "mode":
        raise UserError(f"--sparse-set {item}: the mode is chosen by --attention; drop this override")
    if key not in SETTING_KEYS:
        close = difflib.get_close_matches(key, SETTING_KEYS, n=1)
        fix = f"did you mean {close[0]}?" if close else f"use one of {', '.join(SETTING_KEYS)}"
        raise UserError(f"--sparse-set {item}: {key!r} is not a sparse attention setting; {fix}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text  # as recipe overrides do: the type check below names what was expected
    return key, value


def _run_attention_section(config_file: Path) -> dict[str, Any]:
    try:
        saved = yaml.safe_load(config_file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"MODEL's run config {config_file} is not valid YAML ({str(exc).splitlines()[0]})") from None
    section = saved.get("attention") if isinstance(saved, dict) else None
    return section if isinstance(section, dict) else {}


def sparse_request(model_dir: Path | None, overrides: list[str]) -> SparseRequest:
    """Settings for MODEL: a run trained sparse keeps its own; otherwise (also for model_dir None, a model
    that is not on disk) AttentionConfig's defaults. Then the --sparse-set overrides, in order."""
    parsed = [_override(item) for item in overrides]  # a mistyped key answers before torch is imported
    from mtrain_cli.eval.loading import run_config_file  # torch

    config_file = run_config_file(model_dir) if model_dir is not None else None
    raw: dict[str, Any] = {}
    source = "AttentionConfig defaults"
    if config_file is not None:
        section = _run_attention_section(config_file)
        if section.get("mode") == "sparse":
            raw, source = section, f"attention section of {config_file}"
        else:
            source = f"AttentionConfig defaults ({config_file} trained with dense attention)"
    raw = {**raw, "mode": "sparse"}
    config = _checked(raw, source)
    for item, (key, value) in zip(overrides, parsed):
        raw = {**raw, key: value}
        config = _checked(raw, f"--sparse-set {item}")
    if overrides:
        source += " with --sparse-set overrides"
    return SparseRequest(config, source, list(overrides))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class PrefillPlans:
    """One sparse prefill: its prompt length and its plans' mean over layers (sparse_stats)."""

    length: int
    probed: bool  # prompt >= dense_below: the pattern was estimated; else attention ran dense, recall undefined
    recall: float | None
    density: float


class SparseTracker:
    """What the sparse path did during one eval run: every prefill is checked (each layer must have run
    sparse attention) and its plans' recall and density kept, so the run reports honest means."""

    def __init__(self, request: SparseRequest, router: AttentionRouter):
        self.request, self.router = request, router
        self.prefills: list[PrefillPlans] = []

    def sparse_calls(self) -> int:
        """Attention calls so far in this run that the sparse path served: sparse attention, or dense attention
        where the settings ask for it (a prompt shorter than dense_below, a layer of dense_layers)."""
        from mtrain_cli.attention import SPARSE_PATHS, CallPath

        calls = self.router.calls()
        return sum(calls.get(path.value, 0) for path in (*SPARSE_PATHS, CallPath.DENSE_SHORT, CallPath.DENSE_LAYER))

    def record_prefill(self, length: int, sparse_calls_made: int, layers: int) -> None:
        if sparse_calls_made != layers:
            raise RuntimeError(
                f"sparse prefill of {length} tokens ran sparse attention in {sparse_calls_made} of "
                f"{layers} layers (attention calls so far: {self.router.calls()}); the model must "
                f"be loaded with mtrain's attention hook"
            )
        stats = self.router.sparse_stats()
        probed = length >= self.request.config.dense_below
        assert probed == ("sparse_recall" in stats), "a prompt is planned exactly when it is long"
        # unprobed prompts ran dense attention: every block computed
        self.prefills.append(PrefillPlans(length, probed, stats.get("sparse_recall"), stats.get("sparse_density", 1.0)))

    def report(self) -> dict[str, Any]:
        """For results.json: settings, attention calls per path in this run, mean recall (probed prompts only)
        and mean density (all prompts), each prefill weighing the same."""
        calls = dict(sorted(self.router.calls().items()))
        return {
            "settings": self.request.settings(),
            "settings_source": self.request.source,
            "overrides": self.request.overrides,
            "attention_calls": calls,
            "prefills": len(self.prefills),
            "prefills_probed": sum(p.probed for p in self.prefills),
            "sparse_recall": _mean([p.recall for p in self.prefills if p.probed]),
            "sparse_density": _mean([p.density for p in self.prefills]),
        }


@contextlib.contextmanager
def attention_routing(request: SparseRequest | None) -> Iterator[SparseTracker | None]:
    """Sparse attention in every layer of models loaded with ATTENTION_NAME, for the scope of one eval run,
    and its tracker (for the Runner). Dense (request None) yields None: those models run SDPA, not the hook."""
    if request is None:
        yield None
        return
    from mtrain_cli.attention import AttentionRouter, register_attention

    register_attention()
    with AttentionRouter(request.config) as router:
        yield SparseTracker(request, router)

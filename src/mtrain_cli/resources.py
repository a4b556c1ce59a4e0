"""Where shipped files live: the repo's recipes/ and data/ (editable install) or the wheel's copy."""

from __future__ import annotations

from pathlib import Path

import yaml

from mtrain_cli.errors import UserError

_PACKAGE_DIR = Path(__file__).resolve().parent
_ROOTS = (_PACKAGE_DIR / "_shipped", _PACKAGE_DIR.parents[1])  # wheel copy, then the source checkout


def shipped_path(relative: str) -> Path | None:
    """A shipped file such as `data/tokenizer` or `recipes/tiny.yaml`, or None when absent."""
    for root in _ROOTS:
        candidate = root / relative
        if candidate.exists():
            return candidate
    return None


def recipes_dir() -> Path:
    path = shipped_path("recipes")
    assert path is not None, "the package was installed without its recipes/ directory"
    return path


def recipe_path(name_or_path: str) -> Path:
    """A recipe file path, or the name of a shipped recipe (`tiny`, `tiny.yaml`)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    shipped = recipes_dir() / f"{stem}.yaml"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(sorted(p.stem for p in recipes_dir().glob("*.yaml")))
    raise UserError(f"--recipe {name_or_path!r} is neither a file nor a shipped recipe; shipped: {names}")


def list_recipes() -> list[tuple[str, str]]:
    """(name, one-line description) of every shipped recipe."""
    rows = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        rows.append((path.stem, str(raw.get("run", {}).get("description", "")).strip()))
    return rows

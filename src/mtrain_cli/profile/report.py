"""Profile results on disk: the JSON and its markdown table beside it (rewritten as a sweep progresses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path | None, result: dict[str, Any], table: str) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table + "\n")

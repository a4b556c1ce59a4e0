"""Which code a benchmark ran, for its results file: the git commit and dirty files where git works, and a digest
of src/ either way. The digest is what to trust on a device: its copy of the repository may carry an older .git
than the working tree it runs (a job can name an older commit than the code it ran), and the digest of src/ at any
commit can be computed here to match it."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def src_sha256(repo: Path = REPO) -> str:
    """The first 16 hex digits of a sha256 over src/'s Python files (relative path, then bytes), sorted."""
    digest = hashlib.sha256()
    for p in sorted((repo / "src").rglob("*.py")):
        digest.update(str(p.relative_to(repo)).encode())
        digest.update(p.read_bytes())
    return digest.hexdigest()[:16]


def source_identity() -> dict[str, Any]:
    """{"src_sha256", "git_commit" (None without git), "git_dirty": changed files under src/ and bench/}."""
    info: dict[str, Any] = {"src_sha256": src_sha256()}
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
        info["git_dirty"] = subprocess.run(
            ["git", "status", "--porcelain", "src", "bench"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info

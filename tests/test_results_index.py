"""Committed results stay small and indexed: bench/results (the shipped commands' benchmarks) and each study's
results/ folder hold under 3 MB in all, each folder's README.md lists exactly the files in it, and the markdown
links of the README, docs/ and bench/ resolve, so a moved or folded result cannot leave a dangling link."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_BYTES = 3_000_000
LOGS = "_logs.tar.gz"  # git-ignored: logs stay on the machine that ran them
LINK = re.compile(r"\]\(([^)\s]+)\)")


def results_dirs() -> list[Path]:
    return [REPO / "bench" / "results", *sorted((REPO / "bench").glob("*/results"))]


def result_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(LOGS))


def indexed_names(index: str) -> set[str]:
    """The file names in the table of the index's "## Files" section. A row's first cell names its files in
    backticks; one that starts with "." or "_" continues the first name's stem (`a.md`, `.json`, `_ppl.png`)."""
    section = index.split("\n## Files\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        first, *rest = re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])
        stem = first.split(".", 1)[0]
        names |= {first, *(stem + name if name[0] in "._" else name for name in rest)}
    return names


def test_results_stay_under_3_mb():
    sizes = {path: path.stat().st_size for folder in results_dirs() for path in result_files(folder)}
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert sum(sizes.values()) < MAX_BYTES, [f"{p.relative_to(REPO)}: {sizes[p]:,} B" for p in largest]


def test_each_results_folder_indexes_exactly_its_files():
    for folder in results_dirs():
        index = folder / "README.md"
        assert index.is_file(), f"{folder.relative_to(REPO)} has no README.md index"
        present = {p.name for p in result_files(folder)} - {"README.md"}
        listed = indexed_names(index.read_text())
        where = folder.relative_to(REPO)
        assert sorted(present - listed) == [], f"{where}: files missing from README.md"
        assert sorted(listed - present) == [], f"{where}: README.md lists files that are not there"


def test_markdown_links_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []

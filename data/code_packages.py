"""Python packages of an environment as repository-level text, for data/make_code_corpus.py (not run on its own).

A package: a top-level directory (its .py files, sorted, vendored copies left out) or module of a source root;
its text: every file headed by `# file: <package>/<path>`. Held-out packages: the first in sha256(name) order
holding a share of all the bytes.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

DOC_CHARS = 10**6  # a package's text is cut into documents of at most this many characters
SKIPPED_ENTRIES = {"__pycache__", "site-packages", "dist-packages"}
# copies of other packages (a held-out package's copy inside a training one would leak it)
VENDORED_DIRS = {"_vendor", "vendor", "vendored", "_vendored", "extern", "_extern", "_distutils"}


@dataclass
class Package:
    name: str  # import name
    origin: str  # "stdlib" or "site"
    files: list[tuple[Path, str, int]]  # (path, name shown in its header, bytes), sorted

    @property
    def num_bytes(self) -> int:
        return sum(size for _, _, size in self.files)


def source_roots(given: list[str]) -> list[tuple[str, Path]]:
    if given:
        roots = [("site", Path(p).expanduser()) for p in given]
    else:
        roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
        roots += [("site", Path(p)) for p in site.getsitepackages()]
    unique, seen = [], set()
    for origin, path in roots:
        if path.is_dir() and path.resolve() not in seen:
            seen.add(path.resolve())
            unique.append((origin, path))
    if not unique:
        raise ValueError(f"--source-root: none of {', '.join(str(p) for _, p in roots)} is a directory")
    return unique


def python_files(top: Path, shown: str, max_file_bytes: int, too_large: Counter) -> list[tuple[Path, str, int]]:
    files = []
    for directory, subdirs, names in os.walk(top):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in SKIPPED_ENTRIES | VENDORED_DIRS)
        for name in sorted(names):
            path = Path(directory) / name
            if name.endswith(".py") and path.is_file():
                size = path.stat().st_size
                if size > max_file_bytes:
                    too_large["files"] += 1
                    continue
                files.append((path, f"{shown}/{path.relative_to(top).as_posix()}", size))
    return files


def discover(roots: list[tuple[str, Path]], max_file_bytes: int) -> tuple[list[Package], Counter]:
    """Top-level packages and modules in root order; a name seen in an earlier root wins."""
    packages: dict[str, Package] = {}
    skipped = Counter()
    for origin, root in roots:
        for entry in sorted(root.iterdir()):
            name = entry.name.removesuffix(".py")
            if (
                entry.name in SKIPPED_ENTRIES
                or entry.name.startswith(".")
                or "." in name
                or name in packages
                or not (entry.is_dir() or entry.suffix == ".py")
            ):
                continue
            if entry.is_dir():
                files = python_files(entry, name, max_file_bytes, skipped)
            elif entry.stat().st_size <= max_file_bytes:
                files = [(entry, entry.name, entry.stat().st_size)]
            else:
                skipped["files"] += 1
                continue
            if files:
                packages[name] = Package(name, origin, files)
    return sorted(packages.values(), key=lambda p: p.name), skipped


def held_out_names(packages: list[Package], percent: float, max_package_bytes: int) -> set[str]:
    """The first packages in sha256(name) order that hold `percent` of all bytes (packages capped)."""
    sizes = {p.name: min(p.num_bytes, max_package_bytes) for p in packages}
    names, total = set(), 0
    for name in sorted(sizes, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        if total >= percent / 100 * sum(sizes.values()):
            break
        names.add(name)
        total += sizes[name]
    return names


def package_list_sha256(packages: list[Package]) -> str:
    lines = "".join(f"{p.origin}\t{p.name}\t{len(p.files)}\t{p.num_bytes}\n" for p in packages)
    return hashlib.sha256(lines.encode()).hexdigest()


def capped(package: Package, max_bytes: int) -> Package:
    """The package's first files (sorted order) within `max_bytes`; at least one."""
    files, total = [], 0
    for file in package.files:
        if files and total + file[2] > max_bytes:
            break
        files.append(file)
        total += file[2]
    return Package(package.name, package.origin, files)


def read_text(package: Package) -> tuple[str, int]:
    """(the package's files, each headed by its name; how many files were not UTF-8 and left out)."""
    parts, num_not_utf8 = [], 0
    for path, shown, _ in package.files:
        try:
            parts.append(f"# file: {shown}\n{path.read_bytes().decode('utf-8')}\n")
        except UnicodeDecodeError:
            num_not_utf8 += 1
    return "".join(parts), num_not_utf8


def read_all(packages: list[Package], workers: int, not_utf8: Counter) -> list[str]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(read_text, packages))
    not_utf8["files"] += sum(count for _, count in results)
    return [text for text, _ in results]


def documents(text: str) -> list[str]:
    """Cut at file headers into documents of at most DOC_CHARS (a longer single file stays whole)."""
    docs, start = [], 0
    while len(text) - start > DOC_CHARS:
        cut = text.rfind("# file: ", start + 1, start + DOC_CHARS)
        cut = cut if cut > start else text.find("# file: ", start + DOC_CHARS)
        if cut < 0:
            break
        docs.append(text[start:cut])
        start = cut
    return docs + [text[start:]]

"""The input of the pattern benches run beside the experiment (cap_sweep, recall_by_position): a model, from a
Hugging Face directory or an extension job's parts (joined once under the bench's output), and one long document
of text files joined in sorted order."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

from bench.extension import handoff


def arguments(module: str, doc: str, lengths: str) -> argparse.ArgumentParser:
    """The benches' shared command line (MODEL, --text, --lengths, --out) for `python -m bench.extension.<module>`;
    each bench adds its own options."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.extension.{module}",
        description=doc.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc,
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("--text", required=True, help="a glob of text files (** allowed), joined in sorted order")
    parser.add_argument("--lengths", default=lengths)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def model_directory(model: Path, out: Path) -> Path:
    """`model` itself, or its parts joined into out/model (kept for the next run of the bench)."""
    if not (model / handoff.PARTS_MANIFEST).is_file():
        return model
    joined = out / "model"
    if not (joined / "config.json").is_file():
        handoff.join_parts(model, joined)
    return joined


def document_ids(tokenizer, text_glob: str, length: int) -> list[int]:
    """The first `length` token ids of the files matching text_glob (** allowed), read in sorted order."""
    files, ids = sorted(glob.glob(text_glob, recursive=True)), []
    for path in files:
        ids += tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) >= length:
            return ids[:length]
    raise SystemExit(f"--text: {len(files)} files hold {len(ids)} tokens, fewer than {length}")

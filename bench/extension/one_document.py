"""The input of the pattern benches run beside the experiment (cap_sweep, recall_by_position): a model, from a
Hugging Face directory or an extension job's parts (joined once under the bench's output), and one long document
of text files joined in sorted order."""

from __future__ import annotations

import glob
from pathlib import Path

from bench.extension import handoff


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

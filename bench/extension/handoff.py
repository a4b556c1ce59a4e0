"""What passes between the device jobs of the extension experiment at its scales of several jobs (--phase base,
then extend, or dense and sparse; --phase eval for what evaluations did not fit), and the checks that every job
read the same data. Not run on its own.

  base job    the base export in bf16 (what `mtrain eval` loads on a GPU anyway; half the bytes of mtrain's fp32
              export), as one tar compressed with xz (lzma preset 0) cut into parts of at most 15 MiB, 60 MiB in
              all at most (a device job returns 8 files of 16 MiB; the issue allows 60 MiB). Compressed because
              the parts go back to the device beside the working tree, 64 MiB in all: the 29M base's tar of 57 MiB
              left no room for the tree, and xz makes it 41 MiB in about 5 s (bf16 exponents repeat). A job of
              one extension hands its model on the same way, for an eval job (--model-parts).
              export.json beside the parts records the model, the sha256 of the tar and of each part, the sizes
              of the tar and of the compressed stream, the scale and seed, and the corpus's fingerprint: the
              sha256 of the package list it read and of every file it wrote. The job's records and the small
              files its runs, evals and step profile wrote travel as a logs tarball (report.py's bundle) with
              state.json.
  later jobs  check the parts (names, sizes, sha256) and the decompressed tar, and extract the export (an
              extended model's into its restored run directory);
              check the package list before rebuilding the corpus and every corpus file after, and stop at the
              first difference (another environment would train and evaluate on other text); restore the
              earlier jobs' records, runs' metrics and eval outputs into the work directory, so that one report
              covers every job.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
import tarfile
from pathlib import Path
from typing import Any

from data.code_packages import discover, source_roots
from data.code_packages import package_list_sha256 as list_sha256

MiB = 2**20
MAX_EXPORT_BYTES = 60 * MiB
PART_PREFIX = "export.tar.xz."
PARTS_MANIFEST = "export.json"
STATE_FILE = "state.json"  # in the work directory: the job's header and records, bundled with its logs
RESTORED_DIRS = ("logs", "runs", "evals", "profile")  # what a later job takes from an earlier one's bundle


class JobsError(Exception):
    """Why the parts, the corpus or the restored state cannot be used: one line."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# The base export, in bf16, in parts


def bf16_export(source: Path, target: Path) -> Path:
    """A copy of the HF export `source` whose floating-point weights are bf16 (safetensors; config.json says so)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            save_file(
                {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()},
                target / path.name,
                metadata={"format": "pt"},
            )
        elif path.name == "config.json":
            config = json.loads(path.read_text())
            config["dtype"] = "bfloat16"
            (target / path.name).write_text(json.dumps(config, indent=2) + "\n")
        elif path.is_file():
            shutil.copy2(path, target / path.name)
    return target


def tar_of(directory: Path) -> bytes:
    """The directory's files (flat, sorted; no times or owners) as a tar: the same bytes for the same files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=path.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def write_parts(model_dir: Path, out_dir: Path, part_bytes: int, record: dict[str, Any]) -> dict[str, Any]:
    """model_dir as export.tar.xz.NN parts of at most `part_bytes` and export.json (with `record`) in out_dir."""
    tar = tar_of(model_dir)
    data = lzma.compress(tar, preset=0)
    if len(data) > MAX_EXPORT_BYTES:
        raise JobsError(
            f"the base export is {len(data) / MiB:.1f} MiB as a compressed tar, over the {MAX_EXPORT_BYTES // MiB} "
            f"MiB that may pass between jobs: train a smaller model"
        )
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    parts = []
    for index, start in enumerate(range(0, len(data), part_bytes)):
        chunk, name = data[start : start + part_bytes], f"{PART_PREFIX}{index:02d}"
        (out_dir / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": sha256_bytes(chunk)})
    manifest = {
        "tar_bytes": len(tar),
        "tar_sha256": sha256_bytes(tar),
        "xz_bytes": len(data),
        "part_bytes": part_bytes,
        "parts": parts,
        "files": sorted(p.name for p in model_dir.iterdir() if p.is_file()),
        **record,
    }
    (out_dir / PARTS_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_parts_manifest(parts_dir: Path) -> dict[str, Any]:
    path = parts_dir / PARTS_MANIFEST
    if not path.is_file():
        raise JobsError(f"--base-parts {parts_dir}: no {PARTS_MANIFEST} (the base job writes it beside its parts)")
    return json.loads(path.read_text())


def join_parts(parts_dir: Path, target: Path) -> dict[str, Any]:
    """Checks every part and the decompressed tar against export.json, extracts the export into `target`.
    -> export.json."""
    manifest = read_parts_manifest(parts_dir)
    names = [part["name"] for part in manifest["parts"]]
    strays = sorted(p.name for p in parts_dir.glob(f"{PART_PREFIX}*") if p.name not in names)
    if strays:
        raise JobsError(
            f"--base-parts {parts_dir}: {', '.join(strays)} not in {PARTS_MANIFEST} (parts of another base job?)"
        )
    chunks = []
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            raise JobsError(f"--base-parts {parts_dir}: part {part['name']} is missing ({len(names)} parts)")
        chunk = path.read_bytes()
        if len(chunk) != part["bytes"] or sha256_bytes(chunk) != part["sha256"]:
            raise JobsError(
                f"--base-parts {parts_dir}: part {part['name']} has {len(chunk):,} bytes, sha256 "
                f"{sha256_bytes(chunk)[:16]}; the base job wrote {part['bytes']:,} bytes, sha256 "
                f"{part['sha256'][:16]} (copied incompletely?)"
            )
        chunks.append(chunk)
    data = lzma.decompress(b"".join(chunks))  # each part's sha256 matched: the stream is the one written
    if sha256_bytes(data) != manifest["tar_sha256"]:
        raise JobsError(
            f"--base-parts {parts_dir}: the decompressed tar's sha256 {sha256_bytes(data)[:16]} is not the "
            f"base job's {manifest['tar_sha256'][:16]}"
        )
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(target, filter="data")
    return manifest


# ---------------------------------------------------------------------------------------------------------
# The corpus: the same in every job


def corpus_fingerprint(corpus: Path) -> dict[str, Any]:
    """The package list's sha256 (manifest.json) and the sha256 of every file the corpus build wrote."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    files = {
        str(p.relative_to(corpus)): sha256_file(p)
        for p in sorted(corpus.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }
    return {"packages_sha256": manifest["packages_sha256"], "num_packages": manifest["num_packages"], "files": files}


def package_list_sha256(corpus_options: dict[str, Any]) -> tuple[str, int]:
    """(sha256, count) of the package list the corpus build would read here now, without building it (seconds)."""
    packages, _ = discover(
        source_roots(corpus_options.get("source_root") or []), int(corpus_options["max_file_kb"] * 1000)
    )
    return list_sha256(packages), len(packages)


def check_package_list(expected: dict[str, Any], corpus_options: dict[str, Any]) -> None:
    found, count = package_list_sha256(corpus_options)
    if found != expected["packages_sha256"]:
        raise JobsError(
            f"this environment's package list has sha256 {found[:16]} ({count} packages); the base job's "
            f"had {expected['packages_sha256'][:16]} ({expected['num_packages']} packages): the corpus "
            f"and held-out split would differ, so the jobs' results could not be compared"
        )


def check_corpus(expected: dict[str, Any], found: dict[str, Any]) -> None:
    if found["packages_sha256"] != expected["packages_sha256"]:
        raise JobsError(
            f"the corpus read packages of sha256 {found['packages_sha256'][:16]}, the base job's "
            f"{expected['packages_sha256'][:16]}"
        )
    names = sorted(set(expected["files"]) | set(found["files"]))
    differ = [name for name in names if expected["files"].get(name) != found["files"].get(name)]
    if differ:
        raise JobsError(
            f"the rebuilt corpus differs from the base job's in {len(differ)} of {len(names)} files "
            f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}) though the package list "
            f"matches: the corpus build is not deterministic here"
        )


# ---------------------------------------------------------------------------------------------------------
# Records across jobs


def save_state(work: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
    (work / STATE_FILE).write_text(
        json.dumps({"work": str(work), "header": header, "records": records}, indent=1, default=str) + "\n"
    )


def restore_state(bundle: Path, work: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Extracts an earlier job's logs, runs and evals from its bundle into `work` (paths in its records moved
    there). -> (its header, its records)."""
    if not bundle.is_file():
        raise JobsError(f"no {bundle}: the earlier job's logs tarball (its records and eval outputs)")
    with tarfile.open(bundle) as tar:
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts[1:]  # below the bundle's top folder
            if parts and (parts[0] in RESTORED_DIRS or parts == (STATE_FILE,)):
                member.name = str(Path(*parts))
                members.append(member)
        tar.extractall(work, members=members, filter="data")
    if not (work / STATE_FILE).is_file():
        raise JobsError(f"{bundle} holds no {STATE_FILE}: not the logs of a --phase base/extend/eval job")
    state = json.loads((work / STATE_FILE).read_text())
    old = state["work"]
    for record in state["records"]:
        for key in ("run_dir", "command"):
            if record.get(key):
                record[key] = record[key].replace(old, str(work))
    return state["header"], state["records"]

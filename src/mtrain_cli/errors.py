"""Errors shown to users as one line, no traceback: bad input (exit code 2), and runs that stop for a reason
outside the input, each with its own exit code (docs/runs.md lists them)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class UserError(Exception):
    """Bad input from the user: the message names the field, the value and the fix."""

    exit_code = 2


class TrainingDiverged(UserError):
    """A non-finite loss or gradient norm: the run stopped without saving or exporting what it produced."""

    exit_code = 3


class DiskFull(UserError):
    """A write failed for want of space; what was partly written is removed, earlier files are intact."""

    exit_code = 4

    def __init__(self, path: Path, needed_bytes: int | None, after: str):
        free = _free_bytes(path)
        need = f"about {_size(needed_bytes)} needed" if needed_bytes else "space needed"
        super().__init__(
            f"no space left on the disk writing {path} ({need}, {_size(free) if free is not None else '?'} free "
            f"there); {after}"
        )
        self.path = path


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether `exc` or anything it wraps is a write that ran out of space: an OSError (ENOSPC, EDQUOT) as the
    cause or context (torch.save reports it as 'unexpected pos'), a DCP CheckpointException's per-rank failures,
    or a writer that only says so in words (safetensors: 'No space left on device (os error 28)')."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in NO_SPACE:
            return True
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for failure in failures.values():
                pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [current.__cause__, current.__context__]
    return False


def _free_bytes(path: Path) -> int | None:
    for parent in [Path(path), *Path(path).parents]:
        if parent.exists():
            return shutil.disk_usage(parent).free
    return None


def _size(num_bytes: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} bytes"

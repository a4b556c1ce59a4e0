"""Token lengths on the command line: `4k,8k,131072` (k = 1024, m = 1024²)."""

from __future__ import annotations

import re

from mtrain_cli.errors import UserError

_LENGTH = re.compile(r"^(\d+)([kKmM]?)$")
_UNIT = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_lengths(text: str, option: str = "--lengths") -> list[int]:
    """-> sorted, deduplicated token counts; a one-line error naming `option` otherwise."""
    lengths = set()
    for item in text.split(","):
        match = _LENGTH.match(item.strip())
        if not match or int(match.group(1)) == 0:
            raise UserError(
                f"{option} {text!r}: {item.strip()!r} is not a length; use positive token counts "
                f"like 4k,8k,131072 (k = 1024)"
            )
        lengths.add(int(match.group(1)) * _UNIT[match.group(2).lower()])
    return sorted(lengths)

"""The README's commands hold up on a fresh clone: every recipe they name is shipped or made by an earlier command,
every `--set` key is a config field, and the demo section says what a first run takes and how its cells vary."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

from mtrain_cli.config import Config
from mtrain_cli.resources import list_recipes

README = Path(__file__).resolve().parents[1] / "README.md"


def commands() -> list[list[str]]:
    """Each command of the README's bash blocks, as words (continuation lines joined, comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def test_every_recipe_a_readme_command_names_is_shipped_or_made_before():
    shipped = {name for name, _ in list_recipes()}
    made: set[str] = set()
    named = 0
    for words in commands():
        if words[:1] == ["cp"]:
            made.add(words[-1])
        for flag, value in itertools.pairwise(words):
            if flag == "--recipe":
                named += 1
                assert value in shipped or value in made, f"README: --recipe {value} is neither shipped nor made"
    assert named >= 3


def test_every_readme_set_key_is_a_config_field():
    fields = {f"{section}.{key}" for section, values in Config().to_dict().items() for key in values}
    keys = [value.split("=")[0] for words in commands() for flag, value in itertools.pairwise(words) if flag == "--set"]
    assert keys and [key for key in keys if key not in fields] == []


def test_the_demo_section_says_what_a_run_takes_as_measured_and_how_its_cells_vary():
    demo = README.read_text().split("## The demo", 1)[1].split("\n## ", 1)[0]
    measured = (README.parent / "bench" / "results" / "demo_cpu.md").read_text()
    alone = re.search(r"\| `make demo` alone \| ([\d.]+) \|", measured)
    assert alone and f": {round(float(alone.group(1)))} s on 2 CPU cores" in demo
    assert re.search(r"cells vary by about ±\d+ points", demo)

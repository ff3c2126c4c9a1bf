"""The README's Python snippets run as written, and its first lines are the two set-up commands."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_commands():
    first = _blocks("bash")[0].strip().splitlines()
    assert README.read_text().startswith("```bash\n")
    assert [line.split("#")[0].strip() for line in first] == ["bash scripts/dev.sh demo", "bash scripts/dev.sh test"]


def test_readme_python_snippets_run_in_order():
    namespace: dict = {"__name__": "readme"}
    blocks = _blocks("python")
    assert blocks, "the README shows Python snippets"
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README is ours

"""The README's example runs as written and prints what the README says it prints."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    return blocks[0]


@pytest.mark.inductor
def test_readme_example_runs_and_prints_its_stats():
    code = _example()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
    claimed = re.search(r"print\(cap\.stats\)\s+# (.*)", code).group(1).strip()
    assert printed.getvalue().strip() == claimed


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text

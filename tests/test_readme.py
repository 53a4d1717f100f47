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


def test_readme_starts_with_install_and_has_no_dead_links():
    text = README.read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[0] == "Install"
    assert "pip install ." in text.split("## Example")[0] and "default backend is Inductor" in text
    assert "model.forward = stampout.compile(model.forward" in text.split("## Benchmarks")[0]
    root = README.parent
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (root / target).exists(), f"README links to {target}, which a clone does not have"
    assert "](bench/out" not in text

"""The size report fails on growth: lines per file, config switches, module-level mutable objects, private torch
names outside the torch_internals package (tests/size_report.py, against tests/size_baseline.json)."""

from __future__ import annotations

import ast
import copy

import size_report

HOW = ("if the growth is deliberate, run `python tests/size_report.py --update` and commit "
       "tests/size_baseline.json, saying why in the message")


def test_nothing_grew_beyond_the_baseline(capsys):
    now, base = size_report.measure(), size_report.load_baseline()
    with capsys.disabled():
        print("\n" + size_report.report(now, base))
    grew = size_report.growth(now, base)
    assert not grew, "grew beyond tests/size_baseline.json:\n  " + "\n  ".join(grew) + "\n" + HOW


def test_growth_of_each_measure_is_caught():
    now = size_report.measure()
    base = copy.deepcopy(now)
    assert size_report.growth(now, base) == []
    base.lines["guards/guard.py"] -= 1
    base.switches -= 1
    rel = next(iter(base.mutable_globals))
    base.mutable_globals[rel] = base.mutable_globals[rel][1:]
    dropped = "torch._C._a_private_name"  # (one more in a module outside torch_internals than the baseline has)
    now.private_torch_names = {**now.private_torch_names, "guards/guard.py": [dropped]}
    grew = size_report.growth(now, base)
    assert [line.split(":")[0] for line in grew] == [
        "src/stampout/guards/guard.py", "config switches", "module-level mutable objects",
        f"private torch names outside {size_report.INTERNALS}"]
    assert dropped in grew[-1]


def test_a_new_file_may_have_the_new_file_limit():
    now = size_report.measure()
    base = copy.deepcopy(now)
    del base.lines["guards/guard.py"]
    assert size_report.growth(now, base) == []  # (guards/guard.py is under the new-file limit)
    now.lines["guards/guard.py"] = size_report.NEW_FILE_LINES + 1
    assert size_report.growth(now, base) == [f"src/stampout/guards/guard.py: {size_report.NEW_FILE_LINES + 1} lines, "
                                             f"limit for a new file {size_report.NEW_FILE_LINES}"]


def test_the_measures_see_what_they_count():
    tree = ast.parse("import torch\nfrom torch._guards import tracing\nA = {}\nB: list = []\n"
                     "C = caches.register({}, 'c')\nD = (1, 2)\n__all__ = []\n"
                     "def f():\n    E = {}\n    return torch._C.DisableTorchFunction()\n")
    assert size_report.mutable_globals(tree) == ["A", "B", "C"]
    assert size_report.private_torch_names(tree) == ["torch._C.DisableTorchFunction", "torch._guards.tracing"]


def test_the_torch_internals_package_is_the_home_of_private_names():
    now = size_report.measure()
    home = [rel for rel in now.lines if rel.startswith(size_report.INTERNALS)]
    assert "torch_internals/__init__.py" in home and len(home) > 1
    tree = ast.parse(open(f"{size_report.PACKAGE}/torch_internals/hooks.py", encoding="utf-8").read())
    assert size_report.private_torch_names(tree)  # (its modules name them: the report leaves them out)
    assert not [rel for rel in now.private_torch_names if rel.startswith(size_report.INTERNALS)]

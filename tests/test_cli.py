"""The `stampout` command line, run in-process through `stampout.cli.main` (and once as a real process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from stampout.cli import TargetError, load_target, main

EXAMPLE = textwrap.dedent("""
    import torch
    import stampout


    class Block(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.scale = scale

        @stampout.region
        def forward(self, x):
            return torch.relu(self.lin(x)) * self.scale


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(1.0), Block(1.0), Block(2.0)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x


    def example():
        return Net(), (torch.randn(2, 8),)


    EXAMPLE = (Net(), (torch.randn(2, 8),), {})
    net = Net()


    def takes_input(x):
        return x


    def wrong_shape():
        return Net()
""")


@pytest.fixture
def example_file(tmp_path):
    path = tmp_path / "example_model.py"
    path.write_text(EXAMPLE)
    return path


def test_help_runs_as_a_process():
    script = os.path.join(os.path.dirname(sys.executable), "stampout")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "stampout.cli"]
    proc = subprocess.run([*cmd, "explain", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "(fn_or_module, args)" in proc.stdout  # the convention is documented


def test_demo_small(capsys):
    assert main(["demo", "--layers", "4", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "1 traced, 3 reused, 0 deduped; 1 distinct subgraph" in out
    assert "ok" in out


def test_demo_against_torch_compile(capsys):
    assert main(["demo", "--layers", "2", "--backend", "eager", "--against-torch-compile"]) == 0
    out = capsys.readouterr().out
    assert "torch.compile, eager" in out and "x stampout's" in out


def test_demo_rejects_bad_hidden(capsys):
    assert main(["demo", "--layers", "2", "--hidden", "30"]) == 2
    assert "multiple of 8" in capsys.readouterr().out


def test_demo_exit_code_when_results_differ(monkeypatch, capsys):
    from stampout.tools import demo

    monkeypatch.setattr(demo, "TOLERANCE", -1.0)  # every difference, even 0, is now too large
    assert main(["demo", "--layers", "2", "--backend", "eager"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_explain_file(example_file, capsys):
    assert main(["explain", f"{example_file}:example"]) == 0
    out = capsys.readouterr().out
    assert "traces=2 reuses=1" in out
    assert "reused -> subgraph_0" in out
    assert "self.scale" in out  # why the third block was not reused


def test_explain_module_attr_tuple(example_file, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(example_file.parent))
    assert main(["explain", "example_model:EXAMPLE"]) == 0
    assert "traces=2 reuses=1" in capsys.readouterr().out
    sys.modules.pop("example_model", None)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("net", "is a module, not an example"),
        ("takes_input", "must take no arguments"),
        ("wrong_shape", "must be (or return) a tuple"),
        ("missing", "has no attribute"),
    ],
)
def test_explain_convention_errors(example_file, capsys, attr, message):
    with pytest.raises(TargetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_target(f"{example_file}:{attr}")
    assert main(["explain", f"{example_file}:{attr}"]) == 2
    assert message in capsys.readouterr().err


def test_explain_bad_target(capsys):
    assert main(["explain", "no_colon_here"]) == 2
    assert main(["explain", "surely_not_a_module_xyz:example"]) == 2
    assert "no module named" in capsys.readouterr().err

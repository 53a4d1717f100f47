"""The `stampout` command line, run in-process through `stampout.cli.main` (and once as a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stampout.cli import TargetError, load_target, main
from stampout.tools.benchmark import VARIANTS

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


@pytest.mark.slow
def test_bench_quick(tmp_path, capsys):
    """Every variant at depths 1 and 2, in this process (the worker interpreter: the test below)."""
    out_dir = tmp_path / "out"
    assert main(["bench", "--quick", "--in-process", "--out", str(out_dir)]) == 0
    assert "capture time" in capsys.readouterr().out
    assert (out_dir / "capture_vs_depth.png").stat().st_size > 0
    results = json.loads((out_dir / "capture_vs_depth.json").read_text())
    assert {"platform", "cpus", "torch"} <= set(results["machine"])
    rows = results["rows"]
    assert {(r["variant"], r["depth"]) for r in rows} == {(v, d) for v in VARIANTS for d in (1, 2)}
    for r in rows:
        assert r["error"] is None, r
        assert r["median_s"] > 0
        assert r["max_abs_diff"] <= 1e-4, r
    regions = {r["depth"]: r for r in rows if r["variant"] == "stampout_regions"}
    assert (regions[2]["traces"], regions[2]["reuses"]) == (1, 1)


@pytest.mark.slow
def test_bench_worker_measures_in_its_own_interpreter():
    """What `stampout bench` runs per (model, variant) without --in-process: a fresh interpreter, its rows as
    JSON on its last line."""
    from stampout.tools import benchmark

    (row,) = benchmark.measure_isolated("llama-like", "stampout_regions", [1], 1)
    assert row["error"] is None, row
    assert (row["model"], row["variant"], row["depth"], row["traces"]) == ("llama-like", "stampout_regions", 1, 1)
    assert row["median_s"] > 0 and row["max_abs_diff"] <= 1e-4, row


def test_bench_user_model_is_the_user_file_decoder():
    """`stampout bench --models user`: bench/user_model.py's decoder, layers marked at class level per variant,
    captured with one trace and the other layers stamped."""
    import stampout
    from stampout.tools import benchmark

    marked, args, kwargs = benchmark.build("user", 3, "stampout_regions")
    nested, _, _ = benchmark.build("user", 3, "dynamo_nested")
    flat, _, _ = benchmark.build("user", 3, "stampout_flat")
    assert type(marked).__module__ == type(flat).__module__ == "stampout_bench_user_model"
    assert [type(m.layers[0]).__name__ for m in (marked, nested, flat)] == ["StampoutLayer", "NestedLayer", "Layer"]
    cap = stampout.capture(marked, *args, **kwargs)
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
    torch_out = marked(*args, **kwargs)
    assert (cap(*args, **kwargs) - torch_out).abs().max().item() == 0

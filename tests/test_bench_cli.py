"""`stampout bench`: every variant at depths 1 and 2 in this process, one (model, variant) in its own interpreter,
and the user-file decoder it measures. (Its own file: the quick bench takes a while, so xdist can run it beside
test_cli.py.)"""

from __future__ import annotations

import json

import pytest

from stampout.cli import main
from stampout.tools.benchmark import VARIANTS


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

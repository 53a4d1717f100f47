"""A new size's symbolic recompile finishes in the background (backends/background.py): calls run the captured
graph eagerly until the C++ builds and module loads are done; a build that fails leaves the eager run."""

from __future__ import annotations

import logging
import threading

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from stampout.backends import background
from stampout.torch_internals import FakeTensorMode


def _symbolic_input(n: int = 8) -> torch.Tensor:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode.from_tensor(torch.ones(n), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))


def _plus_one() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x + 1)


def test_calls_run_eagerly_until_the_builds_are_done():
    release, loaded = threading.Event(), []

    def finish():
        release.wait(30)
        loaded.append(True)

    deferred = background.Deferred(background.eager_runner(_plus_one()), lambda x: x * 3, [finish], "test graph")
    assert deferred(torch.ones(8)).tolist() == [2.0] * 8  # (building: eager)
    release.set()
    assert deferred.wait(30) and loaded == [True]
    assert deferred(torch.ones(8)).tolist() == [3.0] * 8  # compiled


def test_a_build_that_fails_leaves_the_eager_run(caplog):
    def finish():
        raise RuntimeError("no compiler")

    with caplog.at_level(logging.WARNING, logger="stampout.backends"):
        deferred = background.Deferred(background.eager_runner(_plus_one()), lambda x: x * 3, [finish], "test graph")
        assert not deferred.wait(30)
    assert isinstance(deferred.error, RuntimeError) and "runs eagerly" in caplog.text
    assert deferred(torch.ones(4)).tolist() == [2.0] * 4


def test_only_a_symbolic_inference_graph_inside_recompiling_is_deferred():
    fake, static = _symbolic_input(), torch.ones(4)
    assert not background.deferrable([fake])  # (outside recompiling(): a first compile)
    with background.recompiling(True):
        assert background.deferrable([fake]) and not background.deferrable([static])
        with torch.enable_grad():
            assert not background.deferrable([fake.requires_grad_()])  # (training: compiled at once)
    with background.recompiling(False):
        assert not background.deferrable([fake.detach()])

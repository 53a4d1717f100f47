"""A new size's symbolic recompile in the background (backends/background.py): calls run the captured graph
eagerly until the compile is done; guards the compile added are checked per call; a failed compile stays eager."""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from stampout.backends import background
from stampout.torch_internals import FakeTensorMode


def _symbolic_input(n: int = 8) -> tuple[ShapeEnv, torch.Tensor]:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    fake = mode.from_tensor(torch.ones(n), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    return env, fake


def _plus_one() -> fx.GraphModule:
    return fx.symbolic_trace(lambda x: x + 1)


def test_calls_run_eagerly_until_the_compile_is_done_and_outside_the_guards_it_added():
    """The compile assumes the size is above 5 (a guard it adds to the ShapeEnv): once done, it serves sizes
    above 5, and a size of 3 still runs the captured graph eagerly."""
    env, fake = _symbolic_input()
    release = __import__("threading").Event()

    def compile_fn():
        release.wait(30)
        assert bool(fake.shape[0] > 5)  # (evaluating a symbolic comparison records it as a guard)
        return lambda x: x * 3

    with background.recompiling(True) as pending:
        deferred = background.Deferred(_plus_one(), [fake], compile_fn, "test graph")
    assert pending == [deferred]
    deferred.start()
    assert deferred(torch.ones(8)).tolist() == [2.0] * 8  # (compiling: eager)
    release.set()
    assert deferred.wait(30)
    assert deferred(torch.ones(8)).tolist() == [3.0] * 8  # compiled
    assert deferred(torch.ones(3)).tolist() == [2.0] * 3  # outside what the compile assumed: eager


def test_a_compile_that_fails_leaves_the_eager_run(caplog):
    _, fake = _symbolic_input()

    def compile_fn():
        raise RuntimeError("no compiler")

    with background.recompiling(True):
        deferred = background.Deferred(_plus_one(), [fake], compile_fn, "test graph")
    deferred.start()
    with caplog.at_level(logging.WARNING, logger="stampout.backends"):
        assert not deferred.wait(30)
    assert isinstance(deferred.error, RuntimeError) and "runs eagerly" in caplog.text
    assert deferred(torch.ones(4)).tolist() == [2.0] * 4


def test_only_a_symbolic_inference_graph_inside_recompiling_is_deferred():
    _, fake = _symbolic_input()
    static = torch.ones(4)
    assert not background.deferrable([fake])  # (outside recompiling(): a first compile)
    with background.recompiling(True):
        assert background.deferrable([fake]) and not background.deferrable([static])
        with torch.enable_grad():
            assert not background.deferrable([fake.requires_grad_()])  # (training: compiled at once)
    with background.recompiling(False):
        assert not background.deferrable([fake.detach()])

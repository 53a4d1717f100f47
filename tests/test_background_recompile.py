"""A recapture's compile finishes in the background (backends/background.py): a new size's symbolic graph and a
static recapture run eagerly until the C++ builds and module loads are done; a first compile deferred
(`overlap_first_build`) runs eagerly once and its next call waits for them; a build that fails leaves the eager run."""

from __future__ import annotations

import logging
import threading

import pytest
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


def test_only_an_inference_graph_inside_recompiling_is_deferred():
    """A recapture, symbolic or static, runs eagerly until built; a deferred first compile waits at its entry's
    next call; first compiles and training compiles finish at once, and each kind has its switch."""
    from stampout import config

    fake, static = _symbolic_input(), torch.ones(4)
    assert background.deferrable([fake]) is None and background.deferrable([static]) is None  # (a first compile)
    with background.recompiling(True):
        assert background.deferrable([fake]) == background.EAGER == background.deferrable([static])
        with torch.enable_grad():
            assert background.deferrable([fake.requires_grad_()]) is None  # (training: compiled at once)
            assert background.deferrable([torch.ones(4, requires_grad=True)]) is None
        with config.patch(overlap_builds=False):
            assert background.deferrable([static]) is None and background.deferrable([fake.detach()]) is not None
    with config.patch(background_recompile=False), background.recompiling(True):
        assert background.deferrable([fake.detach()]) is None and background.deferrable([static]) == background.EAGER
    with background.recompiling(False):  # (a first compile)
        assert background.deferrable([fake.detach()]) is None and background.deferrable([static]) is None
        with config.patch(overlap_first_build=True):
            assert background.deferrable([fake.detach()]) == background.WAIT == background.deferrable([static])


def test_a_deferred_first_build_runs_eagerly_once_then_waits_for_its_build():
    release, loaded = threading.Event(), []

    def finish():
        release.wait(30)
        loaded.append(True)

    deferred = background.Deferred(background.eager_runner(_plus_one()), lambda x: x * 3, [finish], "test graph",
                                   background.WAIT)
    assert deferred(torch.ones(8)).tolist() == [2.0] * 8  # (the capturing call: eager, the build goes on)
    threading.Timer(0.2, release.set).start()
    assert deferred(torch.ones(8)).tolist() == [3.0] * 8 and loaded == [True]  # (waited for the build: compiled)


@pytest.mark.inductor
def test_a_static_recapture_with_inductor_runs_eagerly_until_built_then_serves_compiled(monkeypatch):
    """dynamic=False: a second shape recaptures with static sizes; its calls run the graph eagerly while the C++
    builds (held here until released: a call that waited for it would not return before), then compiled. Values
    are eager's throughout; one capture per shape."""
    from blocks import NormGelu

    import stampout
    from stampout.backends import direct_call

    release, made = threading.Event(), []
    deferred_init = background.Deferred.__init__

    def held(self, eager, compiled, finish, what, mode=background.EAGER):
        made.append(mode)
        deferred_init(self, eager, compiled, [lambda: release.wait(60), *finish], what, mode)

    monkeypatch.setattr(background.Deferred, "__init__", held)
    torch.manual_seed(0)
    model = torch.nn.Sequential(NormGelu(), NormGelu()).eval()
    fn = stampout.compile(model, backend="inductor", dynamic=False)
    stats = dict(background.STATS)
    try:
        with torch.no_grad():
            for n in (2, 3, 3, 3):  # (the second shape's capturing call, then two calls while it builds)
                x = torch.randn(n, 8)
                torch.testing.assert_close(fn(x), model(x))
            assert made == [background.EAGER] and background.STATS["ready"] == stats["ready"]  # (still building)
            calls = dict(direct_call.calls)
    finally:
        release.set()
    background.wait_all(60)
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(fn(x), model(x))  # (built: compiled, not eager)
    assert {k: background.STATS[k] - stats[k] for k in stats} == {"deferred": 1, "ready": 1, "failed": 0}
    assert sum(direct_call.calls[k] - calls[k] for k in calls) == 2 and fn.stats.captures == 2

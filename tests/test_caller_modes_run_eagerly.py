"""A TorchFunctionMode or TorchDispatchMode the caller holds around a compiled call sees every call eagerly; a
compiled graph (an AOTAutograd backend's cached aten graph above all) would bypass it. Such calls run the program
eagerly, against eager's result under the same mode; once the mode is gone the compiled code runs again."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import stampout


class AddToMul(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.add, torch.Tensor.add, torch.Tensor.__add__):
            func = torch.mul
        return func(*args, **(kwargs or {}))


class AtenAddToMul(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.add.Tensor:
            func = torch.ops.aten.mul.Tensor
        return func(*args, **(kwargs or {}))


class Counted:
    """A backend that runs the graph as is and counts its runs (the compiled code ran, or did not)."""

    def __init__(self, backend: str) -> None:
        self.backend, self.runs = backend, 0

    def __call__(self, gm, example_inputs):
        if self.backend == "aot_eager":
            from stampout.backends import resolve

            inner = resolve("aot_eager")(gm, example_inputs)
        else:
            inner = gm

        def run(*args):
            self.runs += 1
            return inner(*args)
        return run


def program(x):
    return (x + 3).sin()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + 3


@pytest.mark.parametrize("mode", [AddToMul, AtenAddToMul])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_mode_held_around_a_compiled_call_sees_eagers_calls(backend, mode):
    stampout.reset()
    compiled = stampout.compile(program, backend=backend)
    x = torch.full((2,), 2.0)
    torch.testing.assert_close(compiled(x), program(x))
    with mode():
        got = compiled(x)
        expected = program(x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(compiled(x), program(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_module_under_a_mode_runs_eagerly_then_compiled_again(backend):
    stampout.reset()
    torch.manual_seed(0)
    model = Block()
    counted = Counted(backend)
    compiled = stampout.compile(model, backend=counted)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    runs = counted.runs
    with AtenAddToMul():
        torch.testing.assert_close(compiled(x), model(x))
    assert counted.runs == runs  # (the mode saw eager's calls: the compiled code did not run)
    torch.testing.assert_close(compiled(x), model(x))
    assert counted.runs == runs + 1
    assert compiled.stats.captures == 1


def test_the_default_device_context_keeps_compiled_code():
    stampout.reset()
    counted = Counted("eager")
    compiled = stampout.compile(program, backend=counted)
    x = torch.full((2,), 2.0)
    with torch.device("cpu"):
        torch.testing.assert_close(compiled(x), program(x))
        torch.testing.assert_close(compiled(x), program(x))
    assert counted.runs == 2

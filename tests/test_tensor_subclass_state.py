"""A torch.Tensor subclass with its own `__torch_function__` held in the program's state (a global, a module
attribute): compile runs the module that uses it eagerly (eager's values and result class), capture refuses
with the user's line; a Parameter subclass (torch function disabled, as Parameter's) is still captured."""

from __future__ import annotations

import pytest
import torch
from helpers import named_grads, tree_assert_close
from torch import nn

import stampout


class Doubling(torch.Tensor):
    """Doubles what `+` returns: an override stampout's graph would bypass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 2 if func in (torch.Tensor.add, torch.Tensor.__add__) else out


class Tagged(torch.Tensor):
    """torch.Tensor's own __torch_function__: results are `Tagged` too."""


SHIFT = torch.arange(4.0).as_subclass(Doubling)
TAG = torch.ones(4).as_subclass(Tagged)


class UsesGlobal(nn.Module):
    def __init__(self, held):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.held = held

    def forward(self, x):
        return self.lin(x) + (SHIFT if self.held == "shift" else TAG)


@pytest.mark.parametrize("held", ["shift", "tag"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_runs_the_module_eagerly(held, backend):
    model, ref = UsesGlobal(held), UsesGlobal(held)
    fn = stampout.compile(model, backend=backend)
    for i in range(3):
        x = torch.randn(3, 4) + i
        out, expected = fn(x), ref(x)
        assert type(out) is type(expected)
        torch.testing.assert_close(out.as_subclass(torch.Tensor), expected.as_subclass(torch.Tensor))
        out.sum().backward()
        expected.sum().backward()
        tree_assert_close(named_grads(model), named_grads(ref))
    assert [b.module_type for b in fn.breaks] == ["UsesGlobal"]


def test_capture_refuses_naming_the_global_and_line():
    with pytest.raises(stampout.CaptureError, match=r"globals\['SHIFT'\][\s\S]*Doubling[\s\S]*"
                                                    r"test_tensor_subclass_state.py:\d+"):
        stampout.capture(UsesGlobal("shift"), torch.randn(3, 4))


class Weight(nn.Parameter):
    pass


def test_parameter_subclass_is_captured():
    model = nn.Linear(4, 4)
    model.weight = Weight(model.weight.detach().clone())
    x = torch.randn(3, 4)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), model(x))

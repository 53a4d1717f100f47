"""A module call's class lookups (`__call__`, `__getattr__` along the class's MRO: regions/frame._guard_class_names)
are noted as the class holds them without stampout's own attribute watch, also when the watch patches a class later
in the same capture: a subclass of nn.Linear adopted first notes nn.Linear's dict, and a plain nn.Linear watched
after it makes the watch patch nn.Linear (its `__getattr__` shim) while the capture runs (HF's FalconLinear,
ConvNextLayerNorm). The capture must not take its own shim for the program changing a namespace it reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = ScaledLinear(4, 4)  # (a subclass first: its MRO's lookups reach nn.Linear's dict)
        self.block = Inner()  # (then a plain nn.Linear, reached through a child: the watch patches nn.Linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.first(x)))


def test_a_class_patched_by_the_watch_later_in_the_capture_is_not_a_change_of_the_program():
    torch.manual_seed(0)
    model = Mixed()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))
    assert fn.breaks == [] and fn.stats.captures == 1
    assert "runs eagerly" not in fn.explain()
    assert "__getattr__" not in vars(nn.Linear)  # (the watch's shim gone with the capture)


def _same_as_eager_across_a_linear_patch(model: nn.Module, calls_before: int) -> None:
    """`model` compiled and called `calls_before` times; then with nn.Linear.forward wrapped (+1), and after it is
    put back, the compiled call returns eager's."""
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    for _ in range(calls_before):
        fn(x)
    original = nn.Linear.forward
    nn.Linear.forward = lambda self, x: original(self, x) + 1.0
    try:
        torch.testing.assert_close(fn(x), model(x))
    finally:
        nn.Linear.forward = original
    torch.testing.assert_close(fn(x), model(x))


def test_a_patch_of_the_base_class_between_calls_is_still_seen():
    torch.manual_seed(0)
    _same_as_eager_across_a_linear_patch(Mixed(), calls_before=1)


class Doubled(ScaledLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super(ScaledLinear, self).forward(x) * 2.0  # (two-argument super: past ScaledLinear, to nn.Linear)


class Printing(nn.Module):
    """Its own forward calls print (not known to be pure): it runs eagerly, its children compiled (piecewise)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = ScaledLinear(4, 4), Doubled(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(end="")
        return self.second(self.first(x))


@pytest.mark.parametrize("make", [lambda: ScaledLinear(4, 4), lambda: Doubled(4, 4), Printing],
                         ids=["super", "super-two-arguments", "piecewise-children"])
def test_a_library_method_reached_through_super_is_guarded(make):
    """`super().forward(x)` in a user subclass of nn.Linear reads nn.Linear.forward through the super object, which
    no watch sees: nn.Linear.forward patched between calls (a profiler's or adapter's wrapper) is seen."""
    torch.manual_seed(0)
    _same_as_eager_across_a_linear_patch(make(), calls_before=2)

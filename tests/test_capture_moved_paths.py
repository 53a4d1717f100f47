"""A capture's check that the program left every path it reads a parameter through in place (capture/program.py's
moved_parameter) reads module paths the way nn.Module resolves them, without its `__getattr__` per step: a path
rebound past the setters (the instance dict, a registry written directly) is still found, and a module class that
resolves attributes its own way is read through its own lookup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Rebinds(nn.Module):
    """Reads `self.a.weight`, then rebinds the path `self.a` (or `self.a.weight`) one of several ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) + self.b(x)
        if self.how == "instance dict":  # (shadows the registry: Python finds it first)
            self.__dict__["a"] = self.b
        elif self.how == "modules":
            self._modules["a"] = self.b
        elif self.how == "parameters":
            self.a._parameters["weight"] = self.b.weight
        elif self.how == "buffer first":  # (a buffer of that name: nn.Module looks in _parameters first)
            del self.a._parameters["weight"]
            self.a._buffers["weight"] = self.b.weight
        return y


@pytest.mark.parametrize("how", ["instance dict", "modules", "parameters", "buffer first"])
def test_a_path_rebound_past_the_setters_is_refused(how):
    with pytest.raises(stampout.CaptureError, match=r"rebinds the path self\.a\.weight"):
        stampout.capture(Rebinds(how), torch.randn(2, 4))


class Redirects(nn.Module):
    """A module whose own `__getattr__` decides what `self.one` is: once told, its sibling."""

    def __init__(self) -> None:
        super().__init__()
        self.one, self.two = nn.Linear(4, 4), nn.Linear(4, 4)
        self.__dict__["swapped"] = False

    def __getattr__(self, name: str):
        if name == "one" and self.__dict__["swapped"]:
            name = "two"
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.one(x)
        self.__dict__["swapped"] = True
        return y


class Owner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.r = Redirects()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.r(x)


def test_a_module_with_its_own_getattr_is_read_through_it():
    """`self.r.one.weight` now names `two`'s weight: only the class's own `__getattr__` says so."""
    with pytest.raises(stampout.CaptureError, match=r"rebinds the path self\.r\.one\.weight"):
        stampout.capture(Owner(), torch.randn(2, 4))


class Named(nn.Module):
    """A class attribute of the same name as a submodule (a property): Python finds it before the registry."""

    def __init__(self) -> None:
        super().__init__()
        self.inner_ = nn.Linear(4, 4)

    @property
    def lin(self) -> nn.Module:
        return self.inner_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_path_through_a_property_is_not_refused():
    model = Named()
    x = torch.randn(2, 4)
    cap = stampout.capture(model, x)
    torch.testing.assert_close(cap(x), model(x))

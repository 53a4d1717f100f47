"""State changed in place between calls reaches the next call: a list or dict the module holds (appended to, stored
into) is seen and recaptures, and a Python attribute the caller sets on an input tensor after the first call is read."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout

D = 4


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(seed))


class Memory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.memory = [torch.zeros(1, D)]
        self.extra: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + torch.cat(self.memory, 0).sum(0)
        for v in self.extra.values():
            h = h * v
        return h


@pytest.mark.parametrize("change", ["append", "dict store"])
def test_a_list_or_dict_the_module_holds_changed_in_place_is_seen(change):
    torch.manual_seed(0)
    model = Memory()
    fn = stampout.compile(model, backend="eager")
    x = _x()
    torch.testing.assert_close(fn(x), model(x))
    if change == "append":
        model.memory.append(torch.ones(1, D))
    else:
        model.extra["scale"] = 3.0
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2


class ScaledByAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * getattr(x, "weight_scale", 1.0)


def test_an_input_attribute_absent_at_capture_is_read_when_set():
    torch.manual_seed(0)
    model = ScaledByAttribute()
    fn = stampout.compile(model, backend="eager")
    torch.testing.assert_close(fn(_x()), model(_x()))
    x = _x()
    x.weight_scale = 3.0
    torch.testing.assert_close(fn(x), model(x))

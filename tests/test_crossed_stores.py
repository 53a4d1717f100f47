"""A store whose target is reached through a place another store of the same call changes (`h.layers = [h.layers[1],
h.layers[0]]`, then `h.layers[0].k = ...`): the replayed target path named the call's starting objects but was
resolved after the list store, writing the other layer (wrong on the capture call itself). Such a program runs
eagerly; outputs and the caller's objects equal eager's over calls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Layer:
    def __init__(self) -> None:
        self.k = torch.zeros(2)


class Holder:
    def __init__(self) -> None:
        self.layers = [Layer(), Layer()]


class Rotate(nn.Module):
    def __init__(self, on_self: bool) -> None:
        super().__init__()
        self.h, self.on_self = Holder(), on_self

    def forward(self, x: torch.Tensor, arg: Holder) -> torch.Tensor:
        h = self.h if self.on_self else arg
        h.layers = [h.layers[1], h.layers[0]]
        h.layers[0].k = h.layers[0].k + x.sum(0)
        return x + 1


def _run(on_self: bool, compiled: bool) -> list:
    model, arg = Rotate(on_self), Holder()
    fn = stampout.compile(model, backend="eager") if compiled else model
    holder = model.h if on_self else arg
    seen = []
    for i in range(4):
        out = fn(torch.ones(1, 2) * (i + 1), arg)
        seen.append((out.tolist(), [layer.k.tolist() for layer in holder.layers]))
    return seen


@pytest.mark.parametrize("on_self", [True, False], ids=["module-attribute", "argument"])
def test_store_through_a_rebound_path_equals_eager(on_self):
    assert _run(on_self, compiled=True) == _run(on_self, compiled=False)

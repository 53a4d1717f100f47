"""A lifted parameter shadowed by an entry written straight into its module's instance dict
(`m.a.__dict__["weight"] = t`: no `__setattr__`, no EPOCH move; attribute lookup finds the dict entry before
nn.Module.__getattr__ reaches `_parameters`): eager uses the new tensor, the compiled call kept the parameter
(wrong on main). The module's dict is now version-checked per call, so the full check runs and sees it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _outputs(compiled: bool, shadow) -> list:
    torch.manual_seed(0)
    model = Net()
    fn = stampout.compile(model, backend="eager") if compiled else model
    seen = []
    for i in range(4):
        if i == 2:
            model.a.__dict__["weight"] = shadow()
        seen.append(fn(torch.ones(1, 2) * (i + 1)).tolist())
    return seen


@pytest.mark.parametrize("shadow", [lambda: torch.zeros(2, 2), lambda: nn.Parameter(torch.zeros(2, 2))],
                         ids=["tensor", "parameter"])
def test_dict_shadowing_a_parameter_equals_eager(shadow):
    assert _outputs(True, shadow) == _outputs(False, shadow)

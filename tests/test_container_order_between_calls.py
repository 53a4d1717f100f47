"""The order of an nn.ModuleDict's (or ParameterDict's) keys is the order `items()`, `values()` and `for k in` walk:
reordered between calls (the same modules under the same names), the compiled program walks them in the new order,
as eager does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import stampout


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({k: nn.Linear(4, 4) for k in "abc"})
        self.scales = nn.ParameterDict({k: nn.Parameter(torch.full((4,), float(i + 2))) for i, k in enumerate("xy")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = torch.tanh(block(x))
        for name in self.scales:
            x = x * self.scales[name] + 1
        return x


def _move_first_to_end(registry: dict) -> None:
    first = next(iter(registry))
    registry[first] = registry.pop(first)


def _reorder_blocks(model: Chain) -> None:
    _move_first_to_end(model.blocks._modules)


def _reorder_scales(model: Chain) -> None:
    items = list(model.scales.items())
    for k, _ in items:
        del model.scales[k]
    for k, v in reversed(items):
        model.scales[k] = v


@pytest.mark.parametrize("regions", [None, "auto"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("reorder", [_reorder_blocks, _reorder_scales], ids=["ModuleDict", "ParameterDict"])
def test_a_reordered_dict_of_modules_is_walked_in_its_new_order(backend, regions, reorder) -> None:
    torch.manual_seed(0)
    model = Chain()
    reference = copy.deepcopy(model)
    compiled = stampout.compile(model, backend=backend, regions=regions)
    x = torch.randn(2, 4, requires_grad=True)
    for step in range(3):
        if step == 1:
            reorder(model)
            reorder(reference)
        torch.testing.assert_close(compiled(x), reference(x))
    assert compiled.stats.captures == 2

"""A store that leaves an attribute as it was (the object it holds, or an equal int/str/bool of its type) does not
make a compiled function's guards re-check (transformers' generate stores `_previous_max_cache_length` on every
call); any other store does, and the compiled program sees it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout
from stampout.watch.classpatch import EPOCH


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 3
        self.mode = "double"
        self.flag = False
        self.scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.n + torch.copysign(torch.ones(()), torch.tensor(self.scale))
        y = y * 2 if self.mode == "double" else y
        return y + 1 if self.flag is True else y


def _stores_equal(model: Scaled) -> None:
    model.n = int("3")  # (an equal int, another object where ints are not cached: same below)
    model.mode = "".join(["dou", "ble"])
    model.flag = False


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_equal_store_moves_no_epoch_and_keeps_the_entry(backend) -> None:
    model = Scaled()
    compiled = stampout.compile(model, backend=backend)
    x = torch.randn(2, 4)
    compiled(x)
    before = EPOCH.value
    for _ in range(3):
        _stores_equal(model)
        torch.testing.assert_close(compiled(x), Scaled.forward(model, x))
    assert EPOCH.value == before
    assert compiled.stats.captures == 1


@pytest.mark.parametrize("change", [("n", 4), ("n", True), ("mode", "single"), ("flag", 1), ("flag", True),
                                    ("scale", -0.0), ("n", 3.0)])
def test_a_store_of_another_value_is_seen(change) -> None:
    name, value = change
    model = Scaled()
    compiled = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    compiled(x)
    before = EPOCH.value
    setattr(model, name, value)
    assert EPOCH.value != before
    torch.testing.assert_close(compiled(x), Scaled.forward(model, x))

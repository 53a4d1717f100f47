"""An input object the captured graph holds itself (a `torch.Generator` its random ops draw from): a `Capture`
called with another object raises instead of drawing from the captured one; the same object keeps drawing as
eager does; `compile` follows the object passed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        return self.lin(x) + torch.randn(x.shape, generator=gen)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_capture_called_with_another_generator_raises() -> None:
    model, x = Noisy(), torch.randn(3, 4)
    cap = stampout.capture(model, x, _gen(1))
    with pytest.raises(stampout.StampoutError, match=r"args\[1\] is another Generator than the captured one"):
        cap(x, _gen(2))


def test_capture_called_with_its_generator_draws_as_eager() -> None:
    model, x = Noisy(), torch.randn(3, 4)
    gen, twin = _gen(1), _gen(1)
    cap = stampout.capture(model, x, gen)
    for _ in range(3):
        torch.testing.assert_close(cap(x, gen), model(x, twin))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_draws_from_the_generator_passed(backend: str) -> None:
    model, x = Noisy(), torch.randn(3, 4)
    fn = stampout.compile(model, backend=backend)
    for seed in (1, 2, 3):
        torch.testing.assert_close(fn(x, _gen(seed)), model(x, _gen(seed)))

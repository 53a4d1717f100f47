"""The names a capture gives the tensors it lifts (trace/names.py's walk of the module tree): a tensor held as a
plain attribute of a module, beside attributes of atomic types and objects with their own attribute lookup, is
named by its path, so each call of the Capture reads it again there (never the tensor the capture saw)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class Config:
    """An object answering attribute reads (`__class__` included) in Python, as transformers' configs do."""

    def __getattribute__(self, name: str):
        return object.__getattribute__(self, name)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n, self.label, self.config = 3, "shift", Config()
        self.lin.shift = torch.ones(4)  # (a plain attribute, not a buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.lin.shift * self.n


def _names(cap) -> list[str]:
    return [source.name() for _, source in cap.lifted if source is not None]


def test_a_tensor_attribute_of_the_model_is_read_by_its_path():
    model, x = Shifted(), torch.randn(2, 4)
    cap = stampout.capture(model, x)
    assert "self.lin.shift" in _names(cap)
    model.lin.shift = torch.full((4,), 2.0)
    torch.testing.assert_close(cap(x), model(x))


@pytest.mark.parametrize("shape", ["module", "object"])
def test_a_tensor_attribute_of_a_module_argument_is_read_by_its_path(shape):
    """The same through a module given as an argument (its names are the argument's, not the root's)."""
    inner = Shifted()
    given = inner if shape == "module" else type("Holder", (), {})()
    if shape == "object":
        given.block = inner

    def f(held, x):
        block = held if shape == "module" else held.block
        return block(x)

    x = torch.randn(2, 4)
    cap = stampout.capture(f, given, x)
    assert any(name.endswith("lin.shift") for name in _names(cap)), _names(cap)
    inner.lin.shift = torch.full((4,), 2.0)
    torch.testing.assert_close(cap(given, x), f(given, x))

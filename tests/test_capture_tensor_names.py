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



class _CountedGlobals(dict):
    """A module's globals that count how often they are listed (`items()`), as the names walk lists them."""

    listed = 0

    def items(self):
        type(self).listed += 1
        return super().items()


def _module_of_functions(count: int) -> dict:
    """A user module's globals: `count` functions calling the next, the last scaling by a global tensor."""
    lines = ["import torch", "SCALE = torch.full((4,), 3.0)"]
    lines += [f"def f{i}(x):\n    return f{i + 1}(x)" for i in range(count - 1)]
    lines.append(f"def f{count - 1}(x):\n    return x * SCALE")
    namespace = _CountedGlobals(__name__="user_functions")
    exec(compile("\n".join(lines), "user_functions.py", "exec"), namespace)  # noqa: S102
    return namespace


def test_a_modules_globals_are_listed_once_however_many_functions_share_them():
    """The names walk lists a module's globals once per capture, not once per function found there (a module's
    functions share its globals dict: F functions x G globals before); the global tensor is still found by its
    global name, and each call reads it again."""
    namespace = _module_of_functions(30)
    _CountedGlobals.listed = 0
    fn = namespace["f0"]
    cap = stampout.capture(fn, torch.ones(4))
    assert _CountedGlobals.listed == 1
    assert "globals['SCALE']" in _names(cap)
    namespace["SCALE"] = torch.full((4,), 5.0)
    assert torch.equal(cap(torch.ones(4)), torch.full((4,), 5.0))

"""When a compiled entry refuses a call, the log line says what differs from the capture, by the names a user
reads (`x`, `globals['G']`), never "no difference found"; and the call is right."""

from __future__ import annotations

import logging

import torch
from torch import nn

import stampout

G: torch.Tensor | None = None


class ReadsGlobal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + G


def _misses(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("guard failed")]


def test_a_global_that_is_the_input_runs_eagerly_naming_both(caplog):
    """A tensor read from a global that is the call's input: the trace would see two tensors where eager has one
    (an identity test on them would take the other branch), so that program runs eagerly, the warning naming
    `globals['G']` and `x`; the calls stay right when the global no longer is the input."""
    global G
    model = ReadsGlobal()
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    G = x
    try:
        with caplog.at_level(logging.INFO, logger="stampout"):
            torch.testing.assert_close(fn(x), model(x))
        y = torch.randn(2, 4)
        torch.testing.assert_close(fn(y), model(y))
    finally:
        G = None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("it reads at globals['G'] the tensor it is given as x (the trace sees two tensors, eager one)" in w
               for w in warnings), warnings
    assert _misses(caplog) == []


def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.sin() * b


def test_arguments_that_were_one_tensor_and_are_two_now(caplog):
    fn = stampout.compile(f, backend="eager")
    x = torch.randn(3)
    torch.testing.assert_close(fn(x, x), f(x, x))
    y = torch.randn(3)
    with caplog.at_level(logging.INFO, logger="stampout"):
        torch.testing.assert_close(fn(x, y), f(x, y))
    assert _misses(caplog) == [
        "guard failed for f: inputs: which arguments are the same object differs: expected b is a, got all apart; "
        "capturing again"]

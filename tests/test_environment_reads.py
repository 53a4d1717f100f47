"""The process environment read in forward (`os.getenv`, `os.environ.get`, `in`, iteration) is guarded: a changed
variable captures again, an unchanged one keeps the compiled program (SPEC §4: reads outside the arguments are
guarded)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import stampout

NAME = "STAMPOUT_TEST_ENV_FLAG"
READS = {
    "getenv": lambda: 3.0 if os.getenv(NAME) == "1" else 1.0,
    "environ.get": lambda: float(os.environ.get(NAME, "1")) + 1.0,
    "in": lambda: 2.0 if NAME in os.environ else 1.0,
    "iteration": lambda: 2.0 if any(k == NAME for k in os.environ) else 1.0,
}


class ReadsEnv(nn.Module):
    def __init__(self, read) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.read()


@pytest.fixture
def env_var():
    os.environ.pop(NAME, None)
    yield
    os.environ.pop(NAME, None)


@pytest.mark.parametrize("how", list(READS))
def test_a_changed_environment_variable_is_seen_by_later_calls(how, env_var):
    torch.manual_seed(0)
    model, x = ReadsEnv(READS[how]), torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager")
    for value in (None, None, "1", "1", "4", None):
        if value is None:
            os.environ.pop(NAME, None)
        else:
            os.environ[NAME] = value
        torch.testing.assert_close(fn(x), model(x))
    # (captured while unset, set to "1", to "4" (a variable is guarded by its value's identity), and unset again:
    # the first entry is reused)
    assert fn.stats.captures == 3


def test_a_region_reading_the_environment_is_reused_while_it_holds(env_var):
    @stampout.region
    def block(x):
        return x * (2.0 if os.getenv(NAME) == "1" else 1.0)

    def program(x):
        return block(block(block(x)))

    os.environ[NAME] = "1"
    cap = stampout.capture(program, torch.ones(2))
    assert (cap.stats.traces, cap.stats.reuses) == (1, 2)
    torch.testing.assert_close(cap(torch.ones(2)), program(torch.ones(2)))


class _EnvLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if os.environ.get(NAME) == "1" else 1.0)


class _EnvStack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_EnvLayer() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_capture_stamping_every_region_from_an_earlier_entry_keeps_its_environment_guard(env_var):
    """A capture whose region calls are all stamped out from an entry an earlier capture traced (a layer appended:
    the program captures again, the region's entry still holds) imports that entry's guard on the names it read
    (a NAMESPACE guard, whose expected value is None): it was dropped as an argument the frame cannot name, so the
    variable set afterwards was not seen."""
    torch.manual_seed(0)
    model, x = _EnvStack(3), torch.randn(2, 4)
    fn = stampout.compile(model, backend="eager")
    os.environ[NAME] = "1"
    torch.testing.assert_close(fn(x), model(x))
    os.environ[NAME] = "0"
    torch.testing.assert_close(fn(x), model(x))
    model.layers.append(_EnvLayer())  # captured again: every region call stamped from the "0" entry
    torch.testing.assert_close(fn(x), model(x))
    os.environ[NAME] = "1"
    torch.testing.assert_close(fn(x), model(x))

"""An int attribute captured as a symbol admits ints only: a float, a bool or an int subclass of equal value gives
another program in eager (`int_tensor * 3.0` is float, `range(3.0)` raises), so it must recapture, not reuse."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import stampout


class Scales(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + 1


class Repeats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x + 1
        return x


class Settings:
    def __init__(self) -> None:
        self.scale = 2


SETTINGS = Settings()


def _scaled_by_global_settings(x: torch.Tensor) -> torch.Tensor:
    return x * SETTINGS.scale


def _scaled_by_argument(x: torch.Tensor, settings: Settings) -> torch.Tensor:
    return x * settings.scale


class _Flag(int):
    """An int subclass: equal to an int, but not one (a program may branch on its type)."""


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _run(fn, call, values, set_value):
    """Each value set in turn, `fn` against eager; returns the captures made."""
    for value in values:
        set_value(value)
        expected = call(None)
        _same(call(fn), expected)
    return fn.stats.captures


def test_a_module_int_attribute_made_a_symbol_does_not_admit_a_float_or_bool():
    model = Scales()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    x = torch.arange(6, dtype=torch.int64).reshape(2, 3)

    def set_value(v):
        model.scale = v
        reference.scale = v

    def call(f):
        return reference(x) if f is None else f(x)

    # 2: a constant; 5: changed, so a symbol; 3: the symbolic capture; 3.0: a float, another program (float
    # output); 4: the symbolic capture again; True: a bool (not an int); 7: the symbolic capture.
    assert _run(fn, call, [2, 5, 3], set_value) == 2
    assert _run(fn, call, [3.0], set_value) == 3
    assert _run(fn, call, [4], set_value) == 3
    assert _run(fn, call, [True], set_value) == 4
    assert _run(fn, call, [7, _Flag(6)], set_value) == 5
    assert _run(fn, call, [9], set_value) == 5


def test_a_symbolic_int_used_by_range_raises_as_eager_for_a_float():
    model = Repeats()
    fn = stampout.compile(model, backend="eager")
    x = torch.zeros(3)
    for n in (2, 3, 3):  # 3: a symbol, which range() specializes (a shape guard that it is 3)
        model.n = n
        _same(fn(x), x + n)
    assert fn.stats.captures == 2
    model.n = 3.0
    with pytest.raises(TypeError):
        Repeats.forward(model, x)  # eager
    with pytest.raises(TypeError):
        fn(x)


@pytest.mark.parametrize("where", ["global", "argument"])
def test_an_int_on_a_global_or_argument_object_made_a_symbol_admits_ints_only(where):
    settings = SETTINGS if where == "global" else Settings()
    program = _scaled_by_global_settings if where == "global" else _scaled_by_argument
    fn = stampout.compile(program, backend="eager")
    x = torch.arange(4, dtype=torch.int32)
    args = (x,) if where == "global" else (x, settings)

    def set_value(v):
        settings.scale = v

    def call(f):
        return program(*args) if f is None else f(*args)

    try:
        assert _run(fn, call, [2, 5, 3], set_value) == 2
        assert _run(fn, call, [3.0, 2.5], set_value) == 4
        assert _run(fn, call, [6], set_value) == 4
    finally:
        SETTINGS.scale = 2


def test_a_float_attribute_does_not_admit_an_equal_int():
    """Floats are never made symbols: a float attribute is a constant of its exact type (2.0 is not 2)."""
    model = Scales()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="eager")
    x = torch.arange(4, dtype=torch.int64)

    def set_value(v):
        model.scale = v
        reference.scale = v

    def call(f):
        return reference(x) if f is None else f(x)

    assert _run(fn, call, [2.0, 2.0], set_value) == 1
    assert _run(fn, call, [2], set_value) == 2
    assert _run(fn, call, [2.0], set_value) == 2


def test_the_recapture_log_says_the_symbolic_int_is_not_an_int(caplog):
    model = Scales()
    fn = stampout.compile(model, backend="eager")
    x = torch.arange(3)
    with caplog.at_level(logging.INFO, logger="stampout.guards"):
        for value in (2, 5, 3.0):
            model.scale = value
            fn(x)
    assert "self.scale was an int at capture and is float now" in caplog.text

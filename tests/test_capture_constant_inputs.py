"""A `Capture` bakes its non-tensor inputs (ints, bools, floats, strings, None, a module's class) into its graph:
called with a different one, it raises a StampoutError naming the input, what it expected and what it got, and
the caller's line, instead of returning the captured call's result. Called with the same ones, it equals eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


def scaled(x, k, flag):
    return (x + 1 if flag else x - 1) * k


def masked(x, mask=None):
    return x * mask if mask is not None else x


def activation(x, how="relu", eps=1e-5):
    return (torch.relu(x) if how == "relu" else torch.tanh(x)) + eps


CASES = [
    # (program, captured with, called with, the input named, expected, got)
    (scaled, (torch.ones(2), 2, True), {}, (torch.ones(2), 3, True), {}, "args[1]", "2 (int)", "3 (int)"),
    (scaled, (torch.ones(2), 2, True), {}, (torch.ones(2), 2, False), {}, "args[2]", "True", "False"),
    (scaled, (torch.ones(2), 2, True), {}, (torch.ones(2), 2.0, True), {}, "args[1]", "(int)", "(float)"),
    (masked, (torch.ones(2), None), {}, (torch.ones(2), torch.zeros(2)), {}, "args[1]", "None", "tensor"),
    (masked, (torch.ones(2),), {"mask": None}, (torch.ones(2),), {"mask": torch.zeros(2)}, "mask", "None",
     "tensor"),
    (activation, (torch.ones(2),), {"how": "relu"}, (torch.ones(2),), {"how": "tanh"}, "how", "'relu'",
     "'tanh'"),
]


@pytest.mark.parametrize("fn, cap_args, cap_kwargs, args, kwargs, label, expected, got", CASES)
def test_a_different_constant_is_refused(fn, cap_args, cap_kwargs, args, kwargs, label, expected, got):
    cap = stampout.capture(fn, *cap_args, **cap_kwargs)
    torch.testing.assert_close(cap(*cap_args, **cap_kwargs), fn(*cap_args, **cap_kwargs))
    with pytest.raises(stampout.StampoutError) as info:
        cap(*args, **kwargs)
    text = str(info.value)
    assert f"input {label} differs" in text
    assert expected in text.split("got")[0] and got in text.split("got")[1]
    assert "test_capture_constant_inputs.py:" in text
    assert "capture again" in text and "stampout.compile" in text


class Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


class Shift(Scale):
    def forward(self, x):
        return x + self.k


def apply(module, x):
    return module(x)


def test_a_module_input_of_another_class_is_refused():
    x = torch.ones(2)
    cap = stampout.capture(apply, Scale(2.0), x)
    torch.testing.assert_close(cap(Scale(2.0), x), apply(Scale(2.0), x))
    with pytest.raises(stampout.StampoutError, match="differs from the captured one"):
        cap(Shift(2.0), x)


def test_the_same_constants_with_new_tensors_follow_eager():
    cap = stampout.capture(scaled, torch.ones(3), 2, True)
    for x in (torch.randn(3), torch.zeros(3)):
        torch.testing.assert_close(cap(x, 2, True), scaled(x, 2, True))

"""Kernels that cannot run on a capture's fakes: symbolic sizes are specialized or the capture is static; an op
without a fake kernel is a CaptureError saying how to register one."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers import tree_assert_close
from torch import nn

import stampout


@torch.library.custom_op("stampout_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_LIB = torch.library.Library("stampout_test_lib", "DEF")
_LIB.define("thrice(Tensor x) -> Tensor")
_LIB.impl("thrice", lambda x: x * 3, "CPU")

STATIC_ONLY_CALLS = []


@torch.library.custom_op("stampout_test::static_only", mutates_args=())
def static_only(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@static_only.register_fake
def _(x):
    STATIC_ONLY_CALLS.append(tuple(type(s).__name__ for s in x.shape))
    if any(isinstance(s, torch.SymInt) for s in x.shape):
        raise NotImplementedError("this fake kernel takes static shapes only")
    return torch.empty_like(x)


@pytest.mark.parametrize("op, name", [(no_fake, "stampout_test::no_fake"),
                                      (torch.ops.stampout_test_lib.thrice, "stampout_test_lib::thrice")])
def test_op_without_fake_kernel_is_explained(op, name):
    def f(x):
        return op(x.sin()) + 1

    with pytest.raises(stampout.CaptureError) as info:
        stampout.capture(f, torch.randn(3))
    text = str(info.value)
    lines = text.splitlines()
    assert len(lines) == 3, text
    assert name in lines[0] and "no fake (meta) kernel" in lines[0]
    assert "test_kernel_fallbacks.py" in lines[1] and "in f" in lines[1]
    assert "register_fake" in lines[2]


def test_op_without_fake_kernel_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="torch"), pytest.raises(stampout.CaptureError):
        stampout.capture(lambda x: no_fake(x), torch.randn(3))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.lstm(x)[0]).sum(1)


def test_lstm_with_a_symbolic_length_is_specialized():
    """nn.LSTM's kernel calls numel(): the capture specializes the length (guarded) instead of crashing."""
    model = Recurrent()
    x = torch.randn(2, 5, 4)
    torch._dynamo.mark_dynamic(x, 1)
    cap = stampout.capture(model, x)
    tree_assert_close(cap(x), model(x))


def test_lstm_compiles_at_two_lengths():
    model = Recurrent()
    reference = copy.deepcopy(model)
    fn = stampout.compile(model, backend="aot_eager", dynamic=True)
    for t in (5, 7, 5):
        x = torch.randn(2, t, 4)
        tree_assert_close(fn(x), reference(x))


def test_failed_symbolic_capture_falls_back_to_static(caplog):
    def f(x):
        return static_only(x * 2).cos()

    STATIC_ONLY_CALLS.clear()
    fn = stampout.compile(f, backend="aot_eager", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="stampout"):
        for n in (3, 4, 3):
            x = torch.randn(n, 2)
            tree_assert_close(fn(x), f(x))
    assert fn.stats.captures == 2  # one static capture per size; the symbolic one is not tried again
    assert sum("SymInt" in call for call in STATIC_ONLY_CALLS) == 1
    assert any("capturing with static sizes" in r.getMessage() for r in caplog.records)


def test_symbolic_capture_whose_guards_cannot_be_stated_falls_back_to_static():
    """A transposed input (a size-1 dim whose stride is not the product of the others): torch cannot state
    the symbolic capture's guards ("sources must not be empty"); compile captures with static sizes."""
    lin = nn.Linear(4, 4)
    fn = stampout.compile(lin, backend="aot_eager")
    for t in (3, 5, 7, 5):
        x = torch.randn(t, 1, 4).transpose(0, 1)
        tree_assert_close(fn(x), lin(x))

"""One definition of a user class (trace.code.is_user_class), asked by the guards on what a class defines
and by the world snapshot that sees a program write a class attribute. A class made by `exec`, whose module
is not imported, is user code for both."""

from __future__ import annotations

import pytest
import torch

import stampout
from stampout.trace.code import is_user_class


def _exec_class(source: str) -> type:
    namespace = {"__name__": "made_by_exec"}  # (no such module in sys.modules)
    exec(source, namespace)
    return namespace["Config"]


WRITTEN = _exec_class("class Config:\n    pass\n")


def _writes_a_class_attribute(x):
    WRITTEN.last_len = x.shape[0] * 1
    return x + 1


def test_a_written_attribute_of_an_exec_made_class_is_a_side_effect():
    # world.py counted such a class as user code only if it had methods from a user file (exec's "<string>"
    # is not one), so a write went unseen: the compiled call left the trace's symbolic size on the class.
    compiled = stampout.compile(_writes_a_class_attribute, backend="eager", dynamic=True)
    for n in (2, 3, 4):
        torch.testing.assert_close(compiled(torch.ones(n)), torch.ones(n) + 1)
        assert type(WRITTEN.last_len) is int and WRITTEN.last_len == n


def test_a_read_attribute_of_an_exec_made_class_is_guarded():
    config = _exec_class("class Config:\n    scale = 2.0\n")
    settings = config()

    def program(x):
        return x * settings.scale

    compiled = stampout.compile(program, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), x * 2)
    config.scale = 3.0
    torch.testing.assert_close(compiled(x), x * 3)


def test_which_classes_are_user_code():
    class Local:
        pass

    assert is_user_class(Local) and is_user_class(_exec_class("class Config:\n    pass\n"))
    assert not is_user_class(torch.nn.Linear) and not is_user_class(torch.Size) and not is_user_class(object)


class _Act:
    def __call__(self, x):
        return x.relu()


class _Table:
    def __getitem__(self, i):
        return float(i) * 2


_ACT, _TABLE = _Act(), _Table()


def _dispatches_through_dunders(x):
    return _ACT(x) * _TABLE[3]


@pytest.mark.parametrize("patch", ["__call__", "__getitem__"])
def test_a_dunder_method_of_a_user_class_replaced_between_calls_is_seen(patch, monkeypatch):
    # (`act(x)` and `table[3]` reach the class's methods through type slots: no attribute read to guard)
    compiled = stampout.compile(_dispatches_through_dunders, backend="eager")
    x = torch.tensor([-1.0, 2.0])
    torch.testing.assert_close(compiled(x), _dispatches_through_dunders(x))
    if patch == "__call__":
        monkeypatch.setattr(_Act, "__call__", lambda self, x: x.tanh())
    else:
        monkeypatch.setattr(_Table, "__getitem__", lambda self, i: float(i) * 10)
    torch.testing.assert_close(compiled(x), _dispatches_through_dunders(x))

"""One definition of a user class (regions.code.is_user_class), asked by the guards on what a class defines
and by the world snapshot that sees a program write a class attribute. A class made by `exec`, whose module
is not imported, is user code for both."""

from __future__ import annotations

import torch

import stampout
from stampout.regions.code import is_user_class


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

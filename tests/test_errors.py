"""Errors during capture (SPEC §2–3).

Data-dependent Python raises ``stampout.CaptureError`` naming the user's ``file:line`` and suggesting
``torch.where``/``torch.cond``; exceptions raised by the user's own code propagate unchanged.
"""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch
from torch import nn

import stampout

THIS_FILE = os.path.basename(__file__)


def _line_of(fn, marker: str = "# <-- data-dependent") -> int:
    """Line number (in this file) of the line of ``fn``'s source that holds ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if marker in line]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times in {fn.__qualname__}"
    return hits[0]


def _assert_capture_error(fn, *args, line_fn=None, **kwargs) -> stampout.CaptureError:
    with pytest.raises(stampout.CaptureError) as info:
        stampout.capture(fn, *args, **kwargs)
    err = info.value
    msg = str(err)
    line = _line_of(line_fn or (fn.forward if isinstance(fn, nn.Module) else fn))
    # the user's file and the offending line, as file:line
    assert THIS_FILE in msg, msg
    assert re.search(rf"{re.escape(THIS_FILE)}:{line}\b", msg), f"expected {THIS_FILE}:{line} in:\n{msg}"
    assert "torch.where" in msg or "torch.cond" in msg, msg
    # stampout's own error, not torch's internal exception leaking out
    assert type(err) is stampout.CaptureError
    return err


# ------------------------------------------------------------------------------ the hierarchy


def test_error_hierarchy():
    assert issubclass(stampout.CaptureError, stampout.StampoutError)
    assert issubclass(stampout.StampoutError, RuntimeError)
    assert not issubclass(RuntimeError, stampout.StampoutError)
    with pytest.raises(RuntimeError):
        raise stampout.CaptureError("x")


# ------------------------------------------------------------------------------ data-dependent Python


def _if_on_tensor(x):
    y = x * 2
    if y.sum() > 0:  # <-- data-dependent
        return y
    return -y


def _item(x):
    s = x.sum().item()  # <-- data-dependent
    return x * s


def _tolist(x):
    values = x.tolist()  # <-- data-dependent
    return torch.tensor(values)


def _int_of_max(x):
    n = int(x.max())  # <-- data-dependent
    return x[:n]


def _float_of_sum(x):
    scale = float(x.sum())  # <-- data-dependent
    return x * scale


def _tensor_as_list_index(x):
    choices = [1.0, 2.0, 3.0]
    i = x.sum(0).argmax()
    return x * choices[i]  # <-- data-dependent


def _nonzero(x):
    idx = torch.nonzero(x)  # <-- data-dependent
    return idx.float().sum(0)


def _boolean_mask(x):
    pos = x[x > 0]  # <-- data-dependent
    return pos * 2


def _bool_any(x):
    return x + 1 if bool((x > 0).any()) else x - 1  # <-- data-dependent


def _while_loop(x):
    while x.abs().max() > 1:  # <-- data-dependent
        x = x / 2
    return x


@pytest.mark.parametrize(
    "fn",
    [_if_on_tensor, _item, _tolist, _int_of_max, _float_of_sum, _tensor_as_list_index, _nonzero, _boolean_mask,
     _bool_any, _while_loop],
    ids=lambda f: f.__name__.strip("_"),
)
def test_data_dependent_python_raises_capture_error(fn):
    x = torch.randn(4, 3)
    fn(x)  # fine in eager
    _assert_capture_error(fn, x)


def test_data_dependent_in_module_forward():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            if (h > 0).all():  # <-- data-dependent
                h = h * 2
            return h

    m = Gate()
    _assert_capture_error(m, torch.randn(2, 3))


def test_data_dependent_in_helper_names_innermost_user_line():
    def helper(t):
        return t.max().item()  # <-- data-dependent

    def outer(x):
        return x * helper(x)

    _assert_capture_error(outer, torch.randn(2, 3), line_fn=helper)


def test_data_dependent_inside_region():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        @stampout.region
        def forward(self, x):
            h = self.lin(x)
            return h * h.sum().item()  # <-- data-dependent

    layers = nn.Sequential(Layer(), Layer())
    _assert_capture_error(layers, torch.randn(2, 3), line_fn=Layer.forward)


def test_data_dependent_message_names_the_operation():
    err = _assert_capture_error(_item, torch.randn(2, 2))
    assert "item" in str(err)
    err = _assert_capture_error(_nonzero, torch.randn(2, 2))
    assert "nonzero" in str(err)


# ------------------------------------------------------------------------------ the user's own errors


class UserError(Exception):
    pass


def test_user_value_error_propagates_unchanged():
    def fn(x):
        x + 1
        raise ValueError("boom")

    with pytest.raises(ValueError) as info:
        stampout.capture(fn, torch.randn(2))
    assert type(info.value) is ValueError
    assert str(info.value) == "boom"
    assert not isinstance(info.value, stampout.StampoutError)


def test_user_exception_is_the_same_object():
    raised = UserError("mine", 42)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.lin(x)
            raise raised

    with pytest.raises(UserError) as info:
        stampout.capture(M(), torch.randn(1, 2))
    assert info.value is raised
    assert info.value.args == ("mine", 42)


def test_user_error_inside_region_propagates_unchanged():
    @stampout.region
    def block(x):
        if x.shape[0] == 3:
            raise KeyError("bad shape")
        return x * 2

    def fn(x):
        return block(x[:2]) + block(x[1:])

    with pytest.raises(KeyError) as info:
        stampout.capture(fn, torch.randn(4, 2))
    assert type(info.value) is KeyError and info.value.args == ("bad shape",)


def test_torch_error_on_bad_shapes_is_not_swallowed():
    # a genuine shape error from torch must surface as an error (not a silent capture)
    def fn(x, y):
        return x @ y

    with pytest.raises(RuntimeError) as info:
        stampout.capture(fn, torch.randn(2, 3), torch.randn(4, 5))
    assert not isinstance(info.value, stampout.CaptureError) or "shape" in str(info.value).lower()


def test_capture_usable_after_errors():
    def ok(x):
        return x.relu() + 1

    for bad in (_item, _boolean_mask):
        with pytest.raises(stampout.CaptureError):
            stampout.capture(bad, torch.randn(3, 3))
    x = torch.randn(3, 3)
    torch.testing.assert_close(stampout.capture(ok, x)(x), ok(x))


def test_capture_inside_a_capture_is_a_clear_error():
    def inner(x):
        return x + 1

    def outer(x):
        return stampout.capture(inner, x)

    with pytest.raises(stampout.CaptureError, match="while another capture runs"):
        stampout.capture(outer, torch.randn(2))
    assert torch.overrides._get_current_function_mode_stack() == []

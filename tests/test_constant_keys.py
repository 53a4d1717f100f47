"""Python numbers a trace bakes in as constants are compared as eager would tell them apart: a signed zero of a
float subclass or a complex (x / -0.0 is -inf) recaptures; a numpy scalar attribute used by an op compiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class _Float(float):
    pass


def _divides_by(c):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = c

        def forward(self, x):
            return x / self.c.real if isinstance(self.c, complex) else x / self.c

    return M()


@pytest.mark.parametrize(("before", "after"), [(_Float(0.0), _Float(-0.0)), (complex(0.0, 1.0), complex(-0.0, 1.0))],
                         ids=["float-subclass", "complex"])
def test_a_signed_zero_of_a_float_like_constant_is_guarded(before, after):
    model = _divides_by(before)
    compiled = stampout.compile(model, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), model(x))
    model.c = after
    torch.testing.assert_close(compiled(x), model(x))  # got +inf for x / -0.0


def test_a_numpy_scalar_attribute_used_by_an_op_compiles():
    np = pytest.importorskip("numpy")
    model = _divides_by(np.float64(2.0))
    x = torch.ones(2)
    torch.testing.assert_close(stampout.compile(model, backend="eager")(x), model(x))

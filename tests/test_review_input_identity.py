"""A program that tests its input tensor's identity against a tensor in a module global (`for k in KEPT: if x is
k`) keeps eager's branch: the program frame reads the globals its code names while it is made, so it must know
the real input tensors from the start (they were set after: the read went unchecked, the trace's `x is k` was False)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout

KEPT: list[torch.Tensor] = []


class Marks(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * 2
        for k in KEPT:
            if x is k:
                out = out - 100
        return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_an_input_tensor_kept_in_a_global_list_keeps_eagers_branch(backend):
    model, x, y = Marks(), torch.ones(2), torch.ones(2)
    fn = stampout.compile(model, backend=backend)
    try:
        for kept, given in [([], x), ([], x), ([x], x), ([x], x), ([y], x), ([y], y), ([y], x), ([], y)]:
            KEPT[:] = kept
            torch.testing.assert_close(fn(given), model(given))
    finally:
        KEPT.clear()

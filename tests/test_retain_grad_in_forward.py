"""`t.retain_grad()` in forward: eager's `.grad` on the kept tensor after backward (compile runs that module
eagerly, its children compiled), and `capture` refuses with the user's line."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import named_grads, tree_assert_close
from torch import nn

import stampout


class KeepsActivation(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        h.retain_grad()
        self.h = h
        return self.out(h.relu()).sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_module_keeps_the_retained_grad(backend):
    model, ref = KeepsActivation(), KeepsActivation()
    fn = stampout.compile(model, backend=backend)
    for i in range(3):
        x = torch.randn(3, 4) + i
        fn(x).backward()
        ref(x).backward()
        assert model.h.grad is not None
        torch.testing.assert_close(model.h.grad, ref.h.grad)
        tree_assert_close(named_grads(model), named_grads(ref))
    assert [(b.module, b.module_type) for b in fn.breaks] == [("", "KeepsActivation")]  # (children compiled)


def test_capture_refuses_retain_grad_naming_the_line():
    model = KeepsActivation()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(stampout.CaptureError, match=r"retain_grad\(\)[\s\S]*test_retain_grad_in_forward.py:\d+"):
        stampout.capture(model, torch.randn(3, 4))
    tree_assert_close(model.state_dict(), before)

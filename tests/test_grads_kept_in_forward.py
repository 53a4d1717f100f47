"""Tensors whose `.grad` eager autograd fills, made in forward (`t.retain_grad()`, `t.requires_grad_()`,
`t.requires_grad = True`) and kept by the program: eager's `.grad` after backward (compile runs that module eagerly,
its children compiled), and `capture` refuses with the user's line."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import named_grads, tree_assert_close
from torch import nn

import stampout


class KeepsActivation(nn.Module):
    def __init__(self, how="retain_grad"):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.how = how

    def forward(self, x):
        h = self.lin(x)
        if self.how == "retain_grad":
            h.retain_grad()
        elif self.how == "requires_grad_":
            h = h.detach().requires_grad_()
        else:
            h = h.detach()
            h.requires_grad = True
        self.h = h
        return self.out(h.relu()).sum()


HOW = ["retain_grad", "requires_grad_", "setter"]


@pytest.mark.parametrize(("backend", "how"), [(b, h) for b in ("eager", "aot_eager") for h in HOW] + [
    pytest.param("inductor", "retain_grad", marks=pytest.mark.inductor)])
def test_compiled_module_keeps_the_grad(backend, how):
    model, ref = KeepsActivation(how), KeepsActivation(how)
    fn = stampout.compile(model, backend=backend)
    for i in range(3):
        x = torch.randn(3, 4) + i
        fn(x).backward()
        ref(x).backward()
        assert model.h.grad is not None
        torch.testing.assert_close(model.h.grad, ref.h.grad)
        tree_assert_close(named_grads(model), named_grads(ref))
    assert [(b.module, b.module_type) for b in fn.breaks] == [("", "KeepsActivation")]  # (children compiled)


@pytest.mark.parametrize("how", HOW)
def test_capture_refuses_naming_the_line(how):
    model = KeepsActivation(how)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(stampout.CaptureError, match=r"(retain_grad|requires_grad_)\(\)[\s\S]*"
                                                    r"test_grads_kept_in_forward.py:\d+"):
        stampout.capture(model, torch.randn(3, 4))
    tree_assert_close(model.state_dict(), before)

"""Autograd machinery inside the program: a custom `autograd.Function`'s backward, saved-tensors hooks set inside
or around the program, a gradient penalty (double backward). Gradients equal eager's, or the program runs
eagerly with a warning that names why."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from blocks import D, sample, stack_of
from helpers import check_call, check_capture
from torch import nn

import stampout


class Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g * 3.0


@pytest.mark.parametrize("mode", ["capture", "compile"])
def test_case16_custom_autograd_function_backward(mode: str) -> None:
    """A custom `autograd.Function` whose backward is not the derivative of its forward: gradients must equal
    eager's (refusing with a StampoutError is acceptable)."""

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Triple.apply(self.fc(x))

    model = stack_of(Custom, 2)
    try:
        if mode == "capture":
            check_capture(model, sample(grad=True))
        else:
            fn = stampout.compile(model, backend="eager")
            check_call(model, fn, sample(grad=True))
    except stampout.StampoutError:
        pass  # refusing is acceptable; wrong gradients are not


class SavedHooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
            return self.lin(x).tanh() * x


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_saved_tensors_hooks_inside_forward_keep_their_gradients(backend):
    torch.manual_seed(0)
    model = SavedHooks()
    compiled_model = copy.deepcopy(model)
    fn = stampout.compile(compiled_model, backend=backend)
    x = torch.randn(2, 4, requires_grad=True)
    xc = x.detach().clone().requires_grad_(True)
    model(x).sum().backward()
    fn(xc).sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)
    for a, b in zip(compiled_model.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


class Penalty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        y = self.lin(x).sigmoid().sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        return y + g.pow(2).sum()


def test_a_gradient_penalty_under_aot_eager_gives_eager_gradients():
    torch.manual_seed(0)
    model = nn.ModuleList([Penalty(), Penalty()])
    compiled_model = copy.deepcopy(model)

    def run(layers):
        return sum(layer(x) for layer in layers)

    x = torch.randn(3, 4)
    fn = stampout.compile(compiled_model[0], backend="aot_eager")
    fn(x).backward()  # (double backward through a compiled child: AOTAutograd refuses)
    model[0](x).backward()
    for a, b in zip(compiled_model[0].parameters(), model[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_capture_refuses_saved_tensors_hooks_set_inside_the_program():
    torch.manual_seed(0)
    with pytest.raises(stampout.CaptureError, match="saved_tensors_hooks"):
        stampout.capture(SavedHooks(), torch.randn(2, 4, requires_grad=True))


def test_saved_tensors_hooks_around_a_capture_still_apply_when_it_runs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 3, lambda t: t):
        cap = stampout.capture(model, x)
        xc = x.detach().clone().requires_grad_(True)
        cap(xc).sum().backward()
        model(x).sum().backward()
    torch.testing.assert_close(xc.grad, x.grad)


def test_compile_says_why_saved_tensors_hooks_in_forward_run_eagerly(caplog):
    torch.manual_seed(0)
    fn = stampout.compile(SavedHooks(), backend="eager")
    with caplog.at_level(logging.WARNING, logger="stampout"):
        fn(torch.randn(2, 4, requires_grad=True))
    assert any("saved_tensors_hooks" in r.getMessage() and "eagerly" in r.getMessage() for r in caplog.records)


class DoublesInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class WritesThroughFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return DoublesInPlace.apply(self.lin(x) * 1)


def test_a_function_writing_its_input_in_place_is_refused_by_capture_and_run_eagerly_by_compile():
    # (its forward ran on the capture's fakes, leaves that require grad: autograd's RuntimeError escaped)
    torch.manual_seed(0)
    model, x = WritesThroughFunction(), torch.randn(2, 4)
    with pytest.raises(stampout.CaptureError, match="DoublesInPlace cannot run on the capture's tensors"):
        stampout.capture(model, x)
    fn = stampout.compile(model, backend="aot_eager")
    out, expected = fn(x), model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected.sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)

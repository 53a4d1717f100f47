"""`nn.Parameter(t)` / `nn.Buffer(t)` written in the program, of a tensor it computed: eager makes a new leaf on each
call (returned, its .grad is filled; stored on a module, it is registered as a parameter or buffer), a captured graph
would compute a plain tensor. `compile` runs such a module eagerly; `capture` refuses, naming the line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import stampout


class ReturnsLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):
        scale = nn.Parameter(torch.ones(4) * 3)
        return self.lin(x) * scale, scale


class StoresState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.frozen = nn.Parameter(x.mean(0).detach(), requires_grad=False)
        self.total = nn.Buffer(x.sum(0).detach())
        return self.lin(x) * self.frozen + self.total


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_parameter_made_and_returned_gets_its_gradient(backend) -> None:
    torch.manual_seed(0)
    model = ReturnsLeaf()
    reference = copy.deepcopy(model)
    compiled = stampout.compile(model, backend=backend)
    for _ in range(2):
        x = torch.randn(2, 4)
        (out, leaf), (expected, expected_leaf) = compiled(x), reference(x)
        (out.sum() + leaf.sum()).backward()
        (expected.sum() + expected_leaf.sum()).backward()
        torch.testing.assert_close(out, expected)
        assert type(leaf) is nn.Parameter and leaf.grad is not None
        torch.testing.assert_close(leaf.grad, expected_leaf.grad)
        torch.testing.assert_close(model.lin.weight.grad, reference.lin.weight.grad)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_parameter_and_a_buffer_stored_in_forward_are_registered(backend) -> None:
    torch.manual_seed(0)
    model = StoresState()
    reference = copy.deepcopy(model)
    compiled = stampout.compile(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x), reference(x))
        assert type(model.frozen) is nn.Parameter
        assert list(model.state_dict()) == list(reference.state_dict())
        torch.testing.assert_close(model.state_dict(), reference.state_dict())


def test_capture_refuses_naming_the_line() -> None:
    with pytest.raises(stampout.StampoutError, match=r"makes an nn.Parameter of a tensor it computed"):
        stampout.capture(ReturnsLeaf(), torch.randn(2, 4))

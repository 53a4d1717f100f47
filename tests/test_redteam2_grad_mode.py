"""Red-team round (redteam2): a block that runs with grad mode off (`with torch.set_grad_enabled(not self.frozen)`,
`torch.no_grad()`) stops the gradient in eager: the blocks before it get `.grad is None`. Through AOTAutograd a region
call's backward returned zeros for the operand its subgraph used under no_grad, so those blocks got zero gradients
(an optimizer then steps them: weight decay, momentum). backends/undifferentiated.py passes such an operand
detached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout

D = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.frozen = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(not self.frozen):
            return self.lin(x)


class NoGradHead(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frozen:
            with torch.no_grad():
                return torch.relu(self.lin(x))
        return torch.relu(self.lin(x))


class Stack(nn.Module):
    def __init__(self, block: type[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _grads(model: nn.Module) -> dict:
    out = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("regions", [None, "auto"])
@pytest.mark.parametrize("block", [Block, NoGradHead], ids=["set_grad_enabled", "no_grad"])
def test_blocks_before_a_frozen_one_get_no_gradient(block, regions, backend):
    torch.manual_seed(0)
    model = Stack(block)
    fn = stampout.compile(model, backend=backend, regions=regions)
    x = torch.randn(2, D)
    for frozen in (True, False, True):
        model.layers[1].frozen = frozen
        model(x).sum().backward()
        expected = _grads(model)
        fn(x).sum().backward()
        got = _grads(model)
        assert {n: g is None for n, g in got.items()} == {n: g is None for n, g in expected.items()}
        for n, g in expected.items():
            if g is not None:
                torch.testing.assert_close(got[n], g)

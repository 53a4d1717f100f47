"""Red-team round (redteam2): a module that memoizes on its input's identity (`if self._last[0] is x: return
self._last[1]`) returns its cached output in eager when it is given the same tensor again. A compiled program's
trace gets a fake for `x` and the real tensor at `self._last[0]`: the test came out False, and the compiled program
recomputed (silently wrong after the weights changed). Such a call now runs eagerly (program frame: a held tensor
that is the input tensor makes it ineligible); a later capture on another tensor sees the aliasing per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout

D = 4


class Memo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self._last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._last is not None and self._last[0] is x:
            return self._last[1]
        y = self.lin(x)
        self._last = (x, y)
        return y


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Memo()
        self.rest = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x))


def _run(model: nn.Module, call, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i, x in enumerate(inputs):
            if i == 2:
                model.first.lin.weight.mul_(2)
            out.append(call(x).clone())
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("order", ["same", "new-then-same"])
def test_a_memo_on_the_inputs_identity_keeps_eagers_branch(order, backend):
    torch.manual_seed(0)
    a, b = torch.randn(2, D), torch.randn(2, D)
    inputs = [a, a, a, a] if order == "same" else [a, b, b, b]
    eager_model = Stack()
    compiled_model = Stack()
    compiled_model.load_state_dict(eager_model.state_dict())
    expected = _run(eager_model, eager_model, inputs)
    got = _run(compiled_model, stampout.compile(compiled_model, backend=backend), inputs)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)

"""A placeholder lifted late (a buffer first read after a node took its name) keeps a parameter name of its own:
the generated code must not rename one parameter onto another's (`add_1 = add` overwrote the `add_1` argument)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


class NamedLikeNodes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.linear_1 = nn.Linear(4, 4)
        self.register_buffer("add", torch.ones(4))
        self.register_buffer("add_1", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.linear(x)
        c = torch.relu(a) + torch.relu(self.linear_1(x))  # (a node named `add` before the buffers are read)
        return c + self.add + self.add_1 * 10


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_buffers_named_like_nodes_read_late_keep_their_values(backend):
    torch.manual_seed(0)
    model = NamedLikeNodes()
    fn = stampout.compile(model, backend=backend)
    for _ in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1


class NamedLikeBuiltins(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("input_1", torch.full((4,), 2.0))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - (named `input_1` in the graph)
        return input + self.input_1 * 10


def test_a_buffer_named_like_a_renamed_parameter_keeps_its_value():
    model = NamedLikeBuiltins()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        x = torch.randn(4)
        torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1

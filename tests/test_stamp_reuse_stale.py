"""What a stamped call reuses stays keyed on what its trace read: a layer whose parameter shape, dtype or bias
differs from the traced one is traced again (in one capture and in a compiled function's later calls), a
replaced parameter of the same shape is read from the layer at run time, and the root graph names each stamped
layer's parameters after that layer (the names walk shares the sources of the modules above a parameter)."""

from __future__ import annotations

import torch
from torch import nn

import stampout


class Layer(nn.Module):
    def __init__(self, bias: bool = True, out: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(4, out, bias=bias)
        self.proj = nn.Linear(out, 4, bias=False)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.lin(x)))


class Stack(nn.Module):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_layer_with_another_parameter_shape_or_bias_is_traced_again() -> None:
    model = Stack([Layer(), Layer(out=6), Layer(), Layer(bias=False), Layer()])
    x = torch.randn(2, 4)
    cap = stampout.capture(model, x)
    assert (cap.stats.traces, cap.stats.reuses) == (3, 2)
    torch.testing.assert_close(cap(x), model(x))
    names = [n.name for n in cap.gm.graph.nodes if n.op == "placeholder"]
    for i in range(5):
        assert f"layers_{i}_proj_weight" in names  # each stamped layer's own parameters, by its own name


def test_a_compiled_function_retraces_a_layer_changed_between_calls() -> None:
    model = Stack([Layer() for _ in range(3)])
    fn = stampout.compile(model, backend="eager")
    x = torch.randn(2, 4)
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 1
    model.layers[2].proj.weight = nn.Parameter(torch.randn(4, 4))  # same shape: read from the layer per call
    torch.testing.assert_close(fn(x), model(x))
    model.layers[1].lin = nn.Linear(4, 6)  # another shape: what layer 0's trace read differs
    model.layers[1].proj = nn.Linear(6, 4, bias=False)
    torch.testing.assert_close(fn(x), model(x))
    assert fn.stats.captures == 2
    cap = stampout.capture(model, x)
    assert (cap.stats.traces, cap.stats.reuses) == (2, 1)
    torch.testing.assert_close(cap(x), model(x))

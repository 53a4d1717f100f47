"""An attribute the program stores and a region then reads in the same call (`layer.cache = x.tanh(); layer(x)` with
`self.cache` read in the layer's forward): the value is the program's own, stored again by each call before the read.
A region call stamped out from another layer's entry does not carry the entry's guard on it into the compiled
program (it held the capture's fake: every later call failed it and captured again); what the region reads deeper in
an object stored there stays guarded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import stampout


class Settings:
    def __init__(self) -> None:
        self.scale = 1.0


class Layer(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.cache * self.settings.scale + self.k


class Stack(nn.Module):
    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(1.0), Layer(1.0), Layer(2.0)])
        self.settings = settings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            layer.cache = x.sigmoid() if i % 2 else x.tanh()
            layer.settings = self.settings
            x = layer(x)
        return x


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_stored_attribute_a_stamped_region_reads_is_not_guarded_as_state(backend) -> None:
    torch.manual_seed(0)
    model = Stack(Settings())
    reference = copy.deepcopy(model)
    compiled = stampout.compile(model, backend=backend, regions="auto")
    for step in range(6):
        if step == 3:  # (the layers swapped: the stores follow them)
            for m in (model, reference):
                m.layers[0], m.layers[2] = m.layers[2], m.layers[0]
        if step == 4:  # (read through an object stored there: still guarded)
            model.settings.scale = reference.settings.scale = 3.0
        x = torch.randn(2, 4, requires_grad=True)
        out, expected = compiled(x), reference(x)
        torch.testing.assert_close(out, expected)
        out.sum().backward()
        expected.sum().backward()
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        for a, b in zip(model.layers, reference.layers):
            torch.testing.assert_close(a.cache, b.cache)
            assert type(a.cache) is torch.Tensor
    assert compiled.stats.captures == 3  # the first call, the swap, the scale (was: every call)

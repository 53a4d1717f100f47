"""`stampout.export` leaves the model as it found it (issue 22, family 5): buffers the forward mutates, Python
attributes it writes, containers it fills and RNG states are as before, and `ep.module()` starts from there."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

import stampout


class StepCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.lin(x) * self.steps


class Ema(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        self.ema.mul_(0.9).add_(x.mean(0))
        return self.lin(x) + self.ema


class WritesAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.history: list = []
        self.seen: dict = {}

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        self.history.append(1)
        self.seen["last"] = 2
        self.last_batch = x.shape[0]
        return self.lin(x)


class DrawsRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) * (1.0 + 0.0 * random.random())


class Stack(nn.Module):
    """Region layers that each bump a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([StepCounter() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _attributes(model: nn.Module) -> list:
    return [{k: copy.copy(v) for k, v in m.__dict__.items() if not isinstance(v, (torch.Tensor, dict))
             or k in ("seen",)} for m in model.modules()]


@pytest.mark.parametrize("make", [StepCounter, Ema, WritesAttributes, DrawsRandom, Stack],
                         ids=["step counter", "ema", "attributes", "python rng", "region stack"])
def test_export_leaves_the_module_as_it_was(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(2, 3)
    state, attributes = _state(model), _attributes(model)
    random.seed(1)
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    ep = stampout.export(model, x)
    after = _state(model)
    assert list(after) == list(state)
    for name, value in state.items():
        assert torch.equal(after[name], value), name
    assert _attributes(model) == attributes
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert random.getstate() == python_rng
    exported = ep.module()
    for name, value in exported.state_dict().items():
        assert torch.equal(value, state[name]), name
    # ep.module() starts from the original's state: one call of each agrees with one eager call
    twin = copy.deepcopy(model)
    torch.testing.assert_close(exported(x), twin(x))


@pytest.mark.parametrize("make", [StepCounter, Ema], ids=["step counter", "ema"])
def test_export_leaves_the_module_as_torch_export_does(make):
    torch.manual_seed(0)
    ours, theirs = make(), make()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3)
    stampout.export(ours, x)
    torch.export.export(theirs, (x,))
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), name


def test_export_of_a_function_filling_an_input_dict_leaves_the_dict():
    def fn(x, cache):
        cache["k"] = x * 2
        return x + 1

    cache: dict = {"old": 1}
    stampout.export(fn, torch.randn(2), cache)
    assert cache == {"old": 1}

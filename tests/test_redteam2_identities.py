"""Red-team round (redteam2): identity tests the traced Python makes in C code no watch sees — `self is SPECIAL[0]`,
`self in chosen`, `table.get(self)` on a dict (or a WeakKeyDictionary) keyed by modules. They came out False when the
trace was made; a reused region (`self` now `layers[1]`) or a compiled program (`SPECIAL[0] = model.lin` between
calls) took the same branch where eager takes the other: silently wrong, with or without regions."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import stampout

D = 4
SPECIAL: list = [None]
CHOSEN: list = []
TABLE: dict = {}
WEAK = weakref.WeakKeyDictionary()


def _scale(layer: nn.Module, how: str) -> float:
    if how == "is":
        return 2.0 if layer is SPECIAL[0] else 1.0
    if how == "in-list":
        return 2.0 if layer in CHOSEN else 1.0
    if how == "in-tuple":
        return 2.0 if layer in tuple(CHOSEN) else 1.0
    if how == "dict-get":
        return TABLE.get(layer, 1.0)
    return WEAK.get(layer, 1.0)


def _mark(layer: nn.Module, how: str) -> None:
    if how == "is":
        SPECIAL[0] = layer
    elif how in ("in-list", "in-tuple"):
        CHOSEN.append(layer)
    elif how == "dict-get":
        TABLE[layer] = 2.0
    else:
        WEAK[layer] = 2.0


class Block(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * _scale(self, self.how)


class Marked(Block):
    forward = stampout.region(Block.forward)


class Stack(nn.Module):
    def __init__(self, block: type[Block], how: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def _clean():
    SPECIAL[0] = None
    CHOSEN.clear()
    TABLE.clear()
    WEAK.clear()
    yield
    SPECIAL[0] = None
    CHOSEN.clear()
    TABLE.clear()
    WEAK.clear()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("regions", ["plain", "marked", "auto"])
@pytest.mark.parametrize("how", ["is", "in-list", "in-tuple", "dict-get", "weak-get"])
def test_a_module_marked_between_calls_by_identity_is_seen(how, regions, backend):
    """A layer picked out by identity after the first call: eager scales that layer's output, so must the compiled
    program (the region trace made for `layers[0]`, where the test was False, must not be stamped for `layers[1]`)."""
    torch.manual_seed(0)
    model = Stack(Marked if regions == "marked" else Block, how)
    fn = stampout.compile(model, backend=backend, regions="auto" if regions == "auto" else None)
    x = torch.randn(2, D)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), model(x))
        _mark(model.layers[1], how)
        expected = model(x)
        for _ in range(2):
            torch.testing.assert_close(fn(x), expected)


@pytest.mark.parametrize("how", ["is", "dict-get"])
def test_a_module_marked_before_capture_is_seen_in_each_layer(how):
    """Marked before the first call: one region trace per outcome, layer 1 not stamped from layer 0's trace."""
    torch.manual_seed(0)
    model = Stack(Marked, how)
    _mark(model.layers[1], how)
    x = torch.randn(2, D)
    cap = stampout.capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(cap(x), model(x))


def test_tied_submodules_in_one_layer_only_are_told_apart():
    """`self.k is self.q` (a layer whose two projections are one module) is an identity no argument alias shows."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(D, D)
            self.k = nn.Linear(D, D)

        @stampout.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (2.0 if self.k is self.q else 1.0) + 0 * self.q.weight.sum()

    torch.manual_seed(0)
    model = nn.Sequential(Attn(), Attn(), Attn())
    model[2].k = model[2].q
    x = torch.randn(2, D)
    cap = stampout.capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(cap(x), model(x))

"""What a capture pays per stamped layer after the program ran: each module is opened once by the whole walks that
look for traced values left behind (the left-over pass, the stuck-fake check and the world repair share what one walk
found clean), and a path to a parameter hashes from its parent's hash, equal to a path spelled again. Counts, not
times: the walks' soundness is test_world_shared_objects' (a fake left by layer 20 of 32 is still found)."""

from __future__ import annotations

import collections

import torch
from torch import nn

import stampout
from stampout import config
from stampout.sources import Arg, Attr
from stampout.trace import structure


class Config:
    def __init__(self) -> None:
        self.eps = 1e-5
        self.sizes = [8, 8]


class Layer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) + self.cfg.eps


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        cfg = Config()
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(n))
        for layer in self.layers:  # (bound per instance, as transformers' layers are marked: each holds its layer)
            layer.forward = stampout.region(layer.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_layer_module_is_opened_once_by_the_whole_walks(monkeypatch) -> None:
    model = Stack(8)
    opened: collections.Counter = collections.Counter()
    referents = structure.referents

    def counting(v):
        opened[id(v)] += 1
        return referents(v)

    monkeypatch.setattr(structure, "referents", counting)
    monkeypatch.setattr(config, "check_world", False)  # (the suite's own check after the repairs walks again)
    x = torch.randn(2, 8)
    cap = stampout.capture(model, x)
    monkeypatch.undo()
    assert (cap.stats.traces, cap.stats.reuses) == (1, 7)
    torch.testing.assert_close(cap(x), model(x))
    for layer in model.layers[1:]:  # (the stamped ones: a traced layer's own trace walks what it left too)
        for m in layer.modules():
            assert opened[id(m)] == 1, (type(m).__name__, opened[id(m)])
    assert opened[id(model.layers[0].cfg)] == 1


def test_a_path_hashes_as_the_same_path_spelled_again() -> None:
    def path():
        return Attr(Attr(Attr(Attr(Arg(0, "self"), "layers"), "3"), "lin"), "weight")

    a, b = path(), path()
    hash(a.parent)  # (one parent's hash cached, the other's not)
    assert a == b and hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert Attr(Arg(0, "self"), "w") != Attr(Arg(1, "x"), "w")

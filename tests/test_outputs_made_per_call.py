"""Objects a compiled call returns that the program made during the call (not tensors, not the caller's objects):
eager makes a new one each call, so a caller's change to one is never seen by the next call's; and two places
holding one object in eager's output hold one object in the compiled output too. A user object the call made
(no source in the program) makes the program run eagerly (it was the template's constant, shared by every later
call). A set of constants made by the call is made anew per call (it was one shared constant), and a list reached
twice (`return held, held`, a dataclass's `self.alias = self.items`) is one list in each call's output (the template
reaches one node twice, see structure.shared_nodes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import stampout


class Box:
    def __init__(self) -> None:
        self.seen = 0


@dataclasses.dataclass
class Derived:
    y: torch.Tensor
    items: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.alias = self.items


class Make(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = nn.Linear(3, 3), kind

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        if self.kind == "fresh":
            return y, Box()
        if self.kind == "fresh-set":
            return y, set()
        if self.kind == "alias":
            held = [y]
            return held, held
        return Derived(y)


def _shape(kind: str, fn) -> list:
    seen = []
    for _ in range(3):
        out = fn(torch.randn(2, 3))
        if kind == "fresh":
            seen.append(out[1].seen)
            out[1].seen += 1
        elif kind == "fresh-set":
            seen.append(sorted(out[1]))
            out[1].add("mine")
        elif kind == "alias":
            seen.append(out[0] is out[1])
        else:
            seen.append(out.alias is out.items)
    return seen


def test_made_object_output_like_eager():
    model = Make("fresh")
    assert _shape("fresh", stampout.compile(model, backend="eager")) == _shape("fresh", model)


@pytest.mark.parametrize("kind", ["fresh-set", "alias", "state-alias"])
def test_made_outputs_like_eager(kind):
    model = Make(kind)
    assert _shape(kind, stampout.compile(model, backend="eager")) == _shape(kind, model)


@dataclasses.dataclass
class Settings:
    scale: float = 1.0


class ReturnsHeld(nn.Module):
    """Returns a dataclass it holds (a user's settings; transformers' configs are dataclasses too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.settings = nn.Linear(3, 3), Settings()

    def forward(self, x: torch.Tensor):
        return self.lin(x) * self.settings.scale, self.settings


def test_held_dataclass_returned_is_that_object():
    """It was rebuilt (constructor or state) per call: another object, blind to the caller's later changes."""
    model = ReturnsHeld()
    fn = stampout.compile(model, backend="eager")
    for _ in range(3):
        out = fn(torch.randn(2, 3))
        assert out[1] is model.settings
        out[1].note = "seen by the model's own object"
    assert model.settings.note == "seen by the model's own object"

"""A compiled call whose program raises its own exception (`raise ValueError` at a shape it refuses) leaves what eager
leaves: the Python side effects made before the raise (a global dict, a list, an attribute), then eager's exception.
The capture undoes its own effects and the call runs eagerly, once; the next call captures again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stampout


def make_program():
    state = {"counts": {"n": 0}, "log": []}

    def program(x: torch.Tensor) -> torch.Tensor:
        state["counts"]["n"] += 1
        state["log"].append(x.shape[0])
        if x.shape[0] == 3:
            raise ValueError("bad shape")
        return x * 2

    return program, state


def drive(fn, state) -> list:
    seen = []
    for n in (3, 2, 3, 2):
        try:
            seen.append(fn(torch.ones(n)).tolist())
        except ValueError as error:
            seen.append(str(error))
    return [seen, state]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_side_effects_before_the_raise_stay(backend) -> None:
    program, state = make_program()
    expected = drive(program, state)
    program, state = make_program()
    compiled = stampout.compile(program, backend=backend)
    assert drive(compiled, state) == expected
    assert compiled.stats.captures >= 1  # (the size-2 calls are compiled; a raising call keeps nothing)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = x.shape[0]
        if x.shape[0] > 4:
            raise RuntimeError("too long")
        return self.lin(x)


def test_module_attributes_as_eager() -> None:
    torch.manual_seed(0)
    eager, compiled_model = Counting(), Counting()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = stampout.compile(compiled_model, backend="eager")
    for n in (5, 2, 5, 3):
        outcomes = []
        for fn in (eager, compiled):
            try:
                outcomes.append(fn(torch.ones(n, 2)))
            except RuntimeError as error:
                outcomes.append(str(error))
        if isinstance(outcomes[0], str):
            assert outcomes[0] == outcomes[1]
        else:
            torch.testing.assert_close(outcomes[1], outcomes[0])
        assert (compiled_model.calls, compiled_model.last) == (eager.calls, eager.last)

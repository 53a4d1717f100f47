"""A generator or async function cannot be captured by running it once: calling it runs none of its code, and what
it returns would compute its items later, on the capture's fake tensors. `compile` runs it eagerly (saying why in
one warning), `capture` raises a StampoutError naming where it is defined; so does a program that returns a
generator it made. The items are eager's real tensors."""

from __future__ import annotations

import asyncio
import functools
import logging

import pytest
import torch
from torch import nn

import stampout
from stampout.torch_internals import FakeTensor


def scaled(x: torch.Tensor):
    for i in range(3):
        yield x * i


def returns_genexpr(x: torch.Tensor):
    return (x * i for i in range(3))


def wrapped(fn):
    @functools.wraps(fn)
    def call(*args):
        return fn(*args)

    return call


async def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


class Streams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor):
        for _ in range(2):
            x = self.lin(x)
            yield x


def _same_items(got, expected) -> None:
    got, expected = list(got), list(expected)
    assert not any(isinstance(t, FakeTensor) for t in got)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("program", [scaled, returns_genexpr, wrapped(scaled)])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_yields_eagers_tensors(program, backend) -> None:
    stampout.reset()
    compiled = stampout.compile(program, backend=backend)
    for n in (2, 2, 3):
        x = torch.randn(n)
        _same_items(compiled(x), program(x))


def test_compile_of_a_generator_module(caplog) -> None:
    torch.manual_seed(0)
    model = Streams()
    with caplog.at_level(logging.WARNING, logger="stampout"):
        compiled = stampout.compile(model, backend="eager")
        x = torch.randn(3, 2)
        _same_items(compiled(x), model(x))
        _same_items(compiled(x), model(x))
    warnings = [r for r in caplog.records if "generator function" in r.getMessage()]
    assert len(warnings) == 1


def test_compile_of_an_async_function() -> None:
    compiled = stampout.compile(add_one, backend="eager")
    x = torch.ones(2)
    got = asyncio.run(compiled(x))
    assert not isinstance(got, FakeTensor)
    torch.testing.assert_close(got, x + 1)


@pytest.mark.parametrize("program", [scaled, add_one, Streams()])
def test_capture_refuses_naming_the_definition(program) -> None:
    with pytest.raises(stampout.StampoutError, match="generator function|async function") as info:
        stampout.capture(program, torch.ones(2))
    assert f"{__file__}:" in str(info.value)


@pytest.mark.parametrize("program", [returns_genexpr, wrapped(scaled)])
def test_capture_refuses_a_returned_generator(program) -> None:
    with pytest.raises(stampout.StampoutError, match="returns a generator"):
        stampout.capture(program, torch.ones(2))


def test_fullgraph_refuses() -> None:
    with pytest.raises(stampout.StampoutError, match="generator function"):
        stampout.compile(scaled, backend="eager", fullgraph=True)

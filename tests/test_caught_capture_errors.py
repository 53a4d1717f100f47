"""A program that catches the error stampout raises during its capture (`try: if x.sum() > 0: ... except
RuntimeError:`, `contextlib.suppress(Exception)` around `.tolist()`) went on down a path eager does not take: the
capture is invalid. `capture` raises a CaptureError naming the line where stampout's error was raised; `compile` runs
that code eagerly (piecewise), as if the error had not been caught; a region trace that caught one is never reused.
Every case is differential: the result is eager's."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import stampout


def caught_branch(x: torch.Tensor) -> torch.Tensor:
    try:
        if x.sum() > 0:  # data-dependent: stampout's CaptureError, caught below
            return x + 1
        return x - 1
    except RuntimeError:  # a user fallback that eager never takes here
        return x * 100


def suppressed_tolist(x: torch.Tensor) -> torch.Tensor:
    values = [0.0]
    with contextlib.suppress(Exception):
        values = x.tolist()
    return x * len(values)


def converted_error(x: torch.Tensor) -> torch.Tensor:
    try:
        if x.max() > 10:
            return x / 10
    except RuntimeError as error:  # turned into the program's own error (eager raises nothing)
        raise ValueError("no decision") from error
    return x


@pytest.mark.parametrize("program", [caught_branch, suppressed_tolist, converted_error])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_runs_eagers_path(program, backend) -> None:
    stampout.reset()
    compiled = stampout.compile(program, backend=backend)
    for x in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, -2.0, 30.0])):
        torch.testing.assert_close(compiled(x), program(x), rtol=0, atol=0)


@pytest.mark.parametrize("program", [caught_branch, suppressed_tolist, converted_error])
def test_capture_raises_naming_the_line(program) -> None:
    with pytest.raises(stampout.CaptureError, match="caught an error stampout raised") as info:
        stampout.capture(program, torch.tensor([1.0, 2.0, 3.0]))
    assert f"{__file__}:" in str(info.value)


def test_fullgraph_refuses() -> None:
    with pytest.raises(stampout.CaptureError, match="caught an error stampout raised"):
        stampout.compile(caught_branch, backend="eager", fullgraph=True)(torch.ones(2))


class TryLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(100.0)

    @stampout.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        try:
            if h.abs().max() > 100:  # True in eager: h is scaled down
                h = h / 100
        except Exception:
            h = h * 0  # what a trace that caught stampout's error takes
        return h


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_region_that_caught_one_is_not_reused(backend) -> None:
    """The root's capture fails at its end; the layers are then compiled on their own with the shared region
    cache: the trace that took the `except` path must not be stamped out there."""
    torch.manual_seed(0)
    stampout.reset()
    model = nn.Sequential(*[TryLayer() for _ in range(3)])
    compiled = stampout.compile(model, backend=backend)
    x = torch.randn(2, 4)
    for _ in range(2):
        expected = model(x)
        got = compiled(x)
        torch.testing.assert_close(got, expected)
        assert got.abs().sum() > 0
    assert compiled.breaks and all("TryLayer" in b.describe() for b in compiled.breaks)


def test_error_stampout_catches_itself_is_not_counted() -> None:
    """An op that fails in eager too (a shape bug) and that the program catches takes eager's path: captured."""

    def fallback(x: torch.Tensor) -> torch.Tensor:
        try:
            return x @ torch.ones(5, 2)
        except RuntimeError:
            return x.sum(-1)

    x = torch.ones(3, 4)
    cap = stampout.capture(fallback, x)
    torch.testing.assert_close(cap(x), fallback(x))

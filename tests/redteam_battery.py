"""What the red-team batteries (tests/redteam3_programs.py, tests/redteam4_programs.py) share: the registry their
programs join, the small deterministic modules and inputs they build, and the run of one program's calls that
tests/test_redteam3.py and tests/test_redteam4.py compare with eager."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import stampout


def registry() -> tuple[dict[str, Callable], Callable[[Callable], Callable]]:
    """A battery's programs by name, and the decorator that adds one."""
    programs: dict[str, Callable] = {}

    def program(fn: Callable) -> Callable:
        programs[fn.__name__] = fn
        return fn

    return programs, program


def lin(seed=0, d=4):
    g = torch.Generator().manual_seed(seed)
    m = nn.Linear(d, d)
    with torch.no_grad():
        m.weight.copy_(torch.randn(d, d, generator=g))
        m.bias.copy_(torch.randn(d, generator=g))
    return m


def inp(i, n=2, d=4, grad=False):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, d, generator=g, requires_grad=grad)


def grads(m):
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in m.named_parameters()}


def calls(programs: dict[str, Callable], name: str, backend: str | None, n: int = 5) -> list:
    """The observables of `n` calls of program `name`, eagerly (backend None) or compiled, from a fresh world and
    seeds (errors as their text: a program that raises in eager raises the same when compiled)."""
    stampout.reset()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    regions = "auto" if name.startswith("rg_") else None
    run = programs[name]((lambda f: f) if backend is None
                         else (lambda f: stampout.compile(f, backend=backend, regions=regions)))
    out = []
    for i in range(n):
        try:
            out.append(run(i))
        except Exception as error:  # noqa: BLE001 - compared with eager's
            out.append(f"{type(error).__name__}: {str(error).splitlines()[0]}")
    return out


def cases(programs: dict[str, Callable], through_aot: set[str], known_wrong: set) -> list:
    """(name, backend) for each program under eager, and under aot_eager those in `through_aot`; a case in
    `known_wrong` (a name, or a (name, backend) pair) is a strict xfail."""
    import pytest

    pairs = [(name, "eager") for name in programs] + [(name, "aot_eager") for name in programs if name in through_aot]
    return [pytest.param(name, backend, marks=pytest.mark.xfail(strict=True, reason="known wrong"))
            if name in known_wrong or (name, backend) in known_wrong else (name, backend) for name, backend in pairs]


def matches_eager(programs: dict[str, Callable], name: str, backend: str, same: Callable) -> None:
    """Outputs, gradients and the caller's objects after each of five calls, with the changes a user makes between
    them, as eager gives them (`same(got, expected, path)` compares), the world check off as users run."""
    with stampout.config.patch(check_world=False):
        expected = calls(programs, name, None)
        got = calls(programs, name, backend)
    for i, (g, e) in enumerate(zip(got, expected)):
        same(g, e, f"call {i}")
